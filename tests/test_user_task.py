"""A user's own model and data (tests/user_regression.py), from a
directory outside the repository: the exact eval, a task's own pipeline,
gradient accumulation, and every bad-input case in one line. Both forms on
every strategy, with the same weights, are in tests/test_off_path.py."""

import subprocess
import sys

import numpy as np
import pytest

import artifacts
from conftest import run_cli
from conftest import user_project
from test_cli_errors import _assert_one_line_error
from test_cli_errors import _tree_digest

COMMON = ["--train_steps=20", "--batch_size=32", "--steps_per_loop=10",
          "--log_every=10", "--eval_every=0", "--checkpoint_every=0",
          "--optimizer=sgd", "--learning_rate=0.01"]


@pytest.fixture
def outside(tmp_path):
  return user_project(tmp_path, "user_regression.py", "mymod.py")


def _run(cwd, args, module="tfdist.train", timeout=300, prefix=()):
  """`python -m MODULE ARGS` in `cwd`, after `prefix` (an `ip netns exec`
  prefix, say); it must exit 0."""
  proc = subprocess.run([*prefix, sys.executable, "-m", module, *args],
                        cwd=cwd, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc


def test_eval_reports_the_exact_mean_over_the_eval_split(outside):
  """96 eval examples at batch 32 x 2 replicas: 3 batches, one padded."""
  proc = _run(outside, ["--task=mymod:RegressionTask", *COMMON,
                        "--batch_size=64", "--strategy=mirrored",
                        "--num_cpu_devices=2", "--export=false",
                        f"--model_dir={outside / 'e'}"])
  assert "(96 examples)" in proc.stdout
  sys.path.insert(0, str(outside))
  try:
    import keras  # pylint: disable=g-import-not-at-top
    import mymod  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    model = mymod.RegressionTask().build_model()
    checkpoint = tf.train.Checkpoint(model=model)
    checkpoint.restore(tf.train.latest_checkpoint(
        str(outside / "e"))).expect_partial()
    features, labels = mymod._examples(mymod.NUM_EVAL, 1)  # pylint: disable=protected-access
    predicted = model(features).numpy()
    mse = float(np.mean(keras.losses.mean_squared_error(labels, predicted)))
    mae = float(np.mean(np.abs(labels - predicted)))
  finally:
    sys.path.remove(str(outside))
  line = [l for l in proc.stdout.splitlines() if l.startswith("Finished")][0]
  assert f"eval mae {mae:.4f}" in line, (line, mae)
  assert f"eval loss {mse:.4f}" in line, (line, mse)


def test_a_task_with_its_own_input_pipeline(outside):
  proc = _run(outside, ["--task=mymod:FullControlTask", *COMMON,
                        "--eval_steps=3", "--strategy=mirrored",
                        "--num_cpu_devices=2",
                        f"--model_dir={outside / 'own'}"])
  assert "(96 examples)" in proc.stdout  # 3 eval batches of 32.
  assert artifacts.checkpoint_step(str(outside / "own")) == 20


BAD = {
    "module_does_not_import": (["--model=nosuchmodule:build"],
                               "cannot import 'nosuchmodule'"),
    "name_missing": (["--model=mymod:nosuch"],
                     "module 'mymod' has no 'nosuch'"),
    "returns_not_a_model": (["--model=mymod:bad_not_a_model"],
                            "returned a list, not a keras.Model"),
    "returns_not_datasets": (["--model=mymod:build",
                              "--dataset=mymod:bad_not_a_model"],
                             "must return a tfdist.FileData or (train, eval)"),
    "features_do_not_fit": (["--model=mymod:build",
                             "--dataset=mymod:bad_features"],
                            "the dataset's features do not fit the model"),
    "labels_do_not_fit": (["--model=mymod:build",
                           "--dataset=mymod:bad_string_labels"],
                          "the labels do not fit the loss"),
    "scalar_loss": (["--task=mymod:BadScalarLossTask"],
                    "loss returned a scalar"),
    "not_a_task": (["--task=mymod:data"], "not a tfdist.Task"),
    "cannot_pipeline": (["--task=mymod:RegressionTask",
                         "--model_parallel=pipeline", "--num_cpu_devices=2"],
                        "is not a chain of blocks"),
    "own_input_without_eval_steps": (["--task=mymod:FullControlTask"],
                                     "set --eval_steps"),
    "own_input_empty": (["--task=mymod:EmptyInputTask", "--eval_steps=2"],
                        "train_input gave no batch"),
    "accum_does_not_divide": (["--task=mymod:RegressionTask",
                               "--batch_size=32", "--grad_accum_steps=5"],
                              "grad_accum_steps must divide"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_user_code_is_one_line_and_leaves_model_dir(outside, case):
  args, expected = BAD[case]
  model_dir = outside / "kept"
  model_dir.mkdir()
  (model_dir / "ckpt-7.index").write_bytes(b"not really a checkpoint")
  before = _tree_digest(str(model_dir))
  proc = subprocess.run([sys.executable, "-m", "tfdist.train", *args,
                         f"--model_dir={model_dir}"], cwd=outside,
                        capture_output=True, text=True, timeout=300)
  _assert_one_line_error(proc, expected)
  assert _tree_digest(str(model_dir)) == before


def test_gradient_accumulation_gives_the_same_weights(tmp_path, data_dir):
  common = ["--train_steps=30", "--batch_size=64", "--steps_per_loop=10",
            "--eval_every=0", "--checkpoint_every=0", "--export=false",
            f"--data_dir={data_dir}"]
  run_cli(*common, f"--model_dir={tmp_path / 'one'}")
  run_cli(*common, "--grad_accum_steps=4", f"--model_dir={tmp_path / 'k'}")
  run_cli(*common, "--grad_accum_steps=2", "--strategy=mirrored",
          "--num_cpu_devices=2", f"--model_dir={tmp_path / 'km'}")
  expected = artifacts.model_weights(str(tmp_path / "one"))
  for other in ("k", "km"):
    artifacts.assert_weights_close(
        artifacts.model_weights(str(tmp_path / other)), expected, rtol=1e-4)


@pytest.mark.parametrize("task", ["NoRepeatTask", "EndsMidRunTask"])
def test_an_own_input_that_ends_mid_run_is_one_line(outside, task):
  """16 batches, of a length TF knows or not, and 40 steps asked: the run
  stops with one line at the end of the data, not an OutOfRangeError
  traceback. (A finite input long enough for the run is fine.)"""
  proc = subprocess.run(
      [sys.executable, "-m", "tfdist.train", f"--task=mymod:{task}",
       *COMMON, "--train_steps=40", "--eval_steps=2",
       f"--model_dir={outside / 'run'}"], cwd=outside,
      capture_output=True, text=True, timeout=300)
  _assert_one_line_error(proc, "the input ended before the steps asked")
