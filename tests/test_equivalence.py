"""Mirrored over 2 and 4 logical CPUs trains exactly like one device."""

import numpy as np
import pytest

import artifacts
from conftest import run_cli
from conftest import run_launcher

STEPS = 20
COMMON = ["--batch_size=64", "--steps_per_loop=4", "--log_every=2",
          "--eval_every=0", "--checkpoint_every=0", "--seed=7", "--noexport"]


def _train(tmp_path, data_dir, name, *flags, steps=STEPS):
  model_dir = str(tmp_path / name)
  run_cli(f"--model_dir={model_dir}", f"--data_dir={data_dir}",
          f"--train_steps={steps}", *COMMON, *flags)
  return model_dir


def _train_multi_worker(model_dir, data_dir, workers, *flags, steps=STEPS):
  return run_launcher(
      [f"--workers={workers}"],
      [f"--model_dir={model_dir}", f"--data_dir={data_dir}",
       f"--train_steps={steps}", "--strategy=multi_worker_mirrored",
       *COMMON, *flags])


def _assert_same_run(model_dir, reference):
  assert artifacts.checkpoint_step(model_dir) == STEPS
  artifacts.assert_weights_close(artifacts.model_weights(model_dir),
                                 artifacts.model_weights(reference),
                                 rtol=1e-5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
  return _train(tmp_path_factory.mktemp("ref"), data_dir, "default",
                "--strategy=default")


@pytest.mark.parametrize("replicas", [2, 4])
def test_mirrored_matches_default(replicas, reference, tmp_path, data_dir):
  mirrored = _train(tmp_path, data_dir, f"mirrored{replicas}",
                    "--strategy=mirrored", f"--num_cpu_devices={replicas}")
  assert artifacts.checkpoint_step(mirrored) == STEPS
  artifacts.assert_weights_close(artifacts.model_weights(mirrored),
                                 artifacts.model_weights(reference),
                                 rtol=1e-5)
  curve = artifacts.scalars(f"{mirrored}/train", "loss")
  reference_curve = artifacts.scalars(f"{reference}/train", "loss")
  assert [s for s, _ in curve] == list(range(2, STEPS + 1, 2))
  assert [s for s, _ in curve] == [s for s, _ in reference_curve]
  np.testing.assert_allclose([v for _, v in curve],
                             [v for _, v in reference_curve], rtol=1e-5)


@pytest.mark.parametrize("feed", ["auto", "distributed"])
def test_two_worker_mwms_matches_default(feed, reference, tmp_path,
                                         data_dir):
  """Either train feed: a plain iterator per worker (auto, on CPUs) or
  TF's distributed iterator."""
  model_dir = str(tmp_path / "mwms")
  _train_multi_worker(model_dir, data_dir, 2, f"--train_feed={feed}")
  _assert_same_run(model_dir, reference)
  curve = artifacts.scalars(f"{model_dir}/train", "loss")
  reference_curve = artifacts.scalars(f"{reference}/train", "loss")
  np.testing.assert_allclose([v for _, v in curve],
                             [v for _, v in reference_curve], rtol=1e-5)


def test_elastic_resume_two_workers_then_one(reference, tmp_path, data_dir):
  """A checkpoint written by 2 workers resumes on 1 with the same global
  batch, at the saved step, and ends where an uninterrupted run ends."""
  model_dir = str(tmp_path / "elastic")
  _train_multi_worker(model_dir, data_dir, 2, steps=12)
  assert artifacts.checkpoint_step(model_dir) == 12
  proc = run_cli(f"--model_dir={model_dir}", f"--data_dir={data_dir}",
                 f"--train_steps={STEPS}", "--strategy=default", *COMMON)
  assert "at step 12" in proc.stderr and "step 12 -> 20" in proc.stderr
  _assert_same_run(model_dir, reference)


def test_resumed_run_matches_uninterrupted(reference, tmp_path, data_dir):
  """Stopping at step 10 and resuming trains no batch twice."""
  model_dir = str(tmp_path / "resumed")
  common = [f"--model_dir={model_dir}", f"--data_dir={data_dir}",
            "--batch_size=64", "--steps_per_loop=4", "--log_every=2",
            "--eval_every=0", "--checkpoint_every=0", "--seed=7",
            "--noexport", "--strategy=default"]
  run_cli(*common, "--train_steps=10")
  proc = run_cli(*common, f"--train_steps={STEPS}")
  assert "Resumed from" in proc.stderr and "at step 10" in proc.stderr
  assert artifacts.checkpoint_step(model_dir) == STEPS
  artifacts.assert_weights_close(artifacts.model_weights(model_dir),
                                 artifacts.model_weights(reference),
                                 rtol=1e-5)


def test_comparison_detects_a_different_run(reference, tmp_path, data_dir):
  """The check above has teeth: one changed data order fails it."""
  other = _train(tmp_path, data_dir, "other_seed", "--strategy=default",
                 "--seed=8")
  with pytest.raises(AssertionError):
    _assert_same_run(other, reference)
