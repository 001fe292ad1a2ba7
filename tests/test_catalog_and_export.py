"""tfds catalog datasets through a task (offline, tfds.testing.mock_data),
and exports that TF's session-based loader (saved_model_cli, the path TF
Serving's C++ loader takes) restores and runs."""

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from conftest import run_cli

CLI = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")


@pytest.mark.parametrize("task,examples", [("Cifar10", 96),
                                           ("Imdb", 96)])
def test_catalog_dataset_trains_through_a_task(tmp_path, task, examples):
  proc = run_cli(f"--task=tests.tfds_tasks:{task}", "--train_steps=20",
                 "--batch_size=16", "--steps_per_loop=10", "--log_every=10",
                 "--eval_every=0", "--export=false",
                 f"--model_dir={tmp_path / 'run'}")
  assert f"({examples} examples)" in proc.stdout
  assert "Finished at step 20/20" in proc.stdout


def _saved_model_cli_run(export_dir, inputs, out_dir):
  proc = subprocess.run(
      [CLI, "run", "--dir", export_dir, "--tag_set", "serve",
       "--signature_def", "serving_default", "--inputs", inputs,
       "--outdir", str(out_dir), "--overwrite"],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return {name[:-4]: np.load(os.path.join(out_dir, name))
          for name in os.listdir(out_dir)}


def _predict_in_process(export_dir, features):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  serve = tf.saved_model.load(export_dir).signatures["serving_default"]
  if isinstance(features, dict):
    return {k: v.numpy() for k, v in serve(**features).items()}
  return {k: v.numpy() for k, v in serve(images=features).items()}


def test_zoo_export_runs_in_saved_model_cli(tmp_path, data_dir):
  run_cli("--train_steps=50", f"--data_dir={data_dir}",
          f"--model_dir={tmp_path / 'run'}")
  export_dir = str(tmp_path / "run" / "export")
  images = np.random.RandomState(0).uniform(size=(5, 8, 8, 1)).astype(
      np.float32)
  np.save(tmp_path / "x.npy", images)
  served = _saved_model_cli_run(export_dir, f"images={tmp_path / 'x.npy'}",
                                tmp_path / "out")
  assert set(served) == {"logits", "probabilities", "classes"}
  expected = _predict_in_process(export_dir, images)
  np.testing.assert_allclose(served["logits"], expected["logits"],
                             rtol=1e-5)
  np.testing.assert_array_equal(served["classes"],
                                np.argmax(served["logits"], axis=-1))
  # ...and they are the trained model's predictions.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist import models  # pylint: disable=g-import-not-at-top
  model = models.build("mlp", input_shape=(8, 8, 1), num_classes=10)
  model(images)
  tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(
      str(tmp_path / "run"))).expect_partial()
  np.testing.assert_allclose(served["logits"], model(images).numpy(),
                             rtol=1e-5, atol=1e-6)


def test_user_task_export_with_dict_inputs(tmp_path):
  run_cli("--task=tests.user_regression:RegressionTask", "--train_steps=20",
          f"--model_dir={tmp_path / 'run'}")
  export_dir = str(tmp_path / "run" / "export")
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  try:
    import user_regression  # pylint: disable=g-import-not-at-top
    features, _ = user_regression._examples(6, 3)  # pylint: disable=protected-access
  finally:
    sys.path.pop(0)
  np.save(tmp_path / "n.npy", features["numeric"])
  np.save(tmp_path / "c.npy", features["category"])
  served = _saved_model_cli_run(
      export_dir, f"numeric={tmp_path / 'n.npy'};"
      f"category={tmp_path / 'c.npy'}", tmp_path / "out")
  assert set(served) == {"value"}
  expected = _predict_in_process(export_dir, features)
  np.testing.assert_allclose(served["value"], expected["value"], rtol=1e-5)
  # The export is the trained model, not a fresh one: load the checkpoint.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  model = user_regression.RegressionTask().build_model()
  tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(
      str(tmp_path / "run"))).expect_partial()
  np.testing.assert_allclose(served["value"], model(features).numpy(),
                             rtol=1e-5)
