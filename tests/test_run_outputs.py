"""What one run leaves behind: resumable checkpoints, TensorBoard events
with every option in its hparams and the profile TensorBoard shows, a
servable SavedModel; and a corrupt checkpoint is skipped, not trusted."""

import glob
import gzip
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import portpicker
import pytest
import tensorflow as tf

import artifacts
from conftest import run_cli
from tfdist import options as options_lib


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_dir):
  model_dir = str(tmp_path_factory.mktemp("run") / "mirrored")
  proc = run_cli(f"--model_dir={model_dir}", f"--data_dir={data_dir}",
                 "--flagfile=configs/mirrored_cpu2.cfg", "--train_steps=300",
                 "--profile_steps=100,120")
  return model_dir, proc


def test_default_mirrored_run_reaches_accuracy(finished_run):
  model_dir, proc = finished_run
  final = [l for l in proc.stdout.splitlines() if l.startswith("Finished")]
  assert len(final) == 1, proc.stdout
  accuracy = float(final[0].split("eval accuracy ")[1].split(",")[0])
  assert accuracy >= 0.90
  assert artifacts.checkpoint_step(model_dir) == 300
  assert "train step 300/300" in proc.stderr and "ETA" in proc.stderr


def test_console_is_free_of_native_noise(finished_run):
  _, proc = finished_run
  for noise in ("oneDNN", "cpu_feature_guard", "absl::InitializeLog",
                "Reduce to /job", "Traceback"):
    assert noise not in proc.stderr


def test_tensorboard_events(finished_run):
  model_dir, _ = finished_run
  train_tags = artifacts.summary_tags(os.path.join(model_dir, "train"))
  assert {"loss", "accuracy", "learning_rate", "steps_per_sec",
          "examples_per_sec"} <= train_tags
  assert "_hparams_/session_start_info" in train_tags
  assert {"loss", "accuracy"} <= artifacts.summary_tags(
      os.path.join(model_dir, "eval"))
  eval_steps = [s for s, _ in artifacts.scalars(
      os.path.join(model_dir, "eval"), "accuracy")]
  assert eval_steps == [100, 200, 300]
  traces = glob.glob(os.path.join(model_dir, "train", "plugins", "profile",
                                  "*", "*.xplane.pb"))
  assert traces, "no profiler trace"


def test_every_option_reaches_the_hparams_log(finished_run):
  model_dir, _ = finished_run
  assert set(artifacts.hparams(os.path.join(model_dir, "train"))) == {
      o.name for o in options_lib.OPTIONS}


def _get(url):
  with urllib.request.urlopen(url, timeout=10) as response:
    body = response.read()
    if response.headers.get("Content-Encoding") == "gzip":
      body = gzip.decompress(body)
  return json.loads(body)


def test_tensorboard_shows_the_profile(finished_run):
  model_dir, _ = finished_run
  port = portpicker.pick_unused_port()
  board = subprocess.Popen(
      [os.path.join(os.path.dirname(sys.executable), "tensorboard"),
       "--logdir", str(model_dir), "--host", "127.0.0.1", "--port",
       str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 90
    while True:
      try:
        plugins = _get(f"http://127.0.0.1:{port}/data/plugins_listing")
        break
      except OSError:
        if time.monotonic() > deadline:
          raise
        time.sleep(1)
    assert plugins["profile"]["enabled"] is True
    runs = _get(f"http://127.0.0.1:{port}/data/plugin/profile/runs")
    assert "train" in json.dumps(runs), runs
  finally:
    board.terminate()
    board.wait(timeout=30)


def test_memory_per_replica_device_is_logged_and_in_tensorboard(
    finished_run):
  # Adam keeps two slots per weight, on every replica: the state that
  # sharding the optimizer (issue #25) would divide by the replicas.
  model_dir, proc = finished_run
  weights = artifacts.model_weights(model_dir)
  trainable = sum(v.nbytes for k, v in weights.items()
                  if "_trainable_variables" in k)
  train = os.path.join(model_dir, "train")
  for device in ("CPU:0", "CPU:1"):
    [(_, variables)] = artifacts.scalars(train, f"variable_bytes/{device}")
    [(_, state)] = artifacts.scalars(train, f"optimizer_bytes/{device}")
    assert variables == trainable
    # The two slots, plus the step counter and the learning rate.
    assert 2 * trainable < state <= 2 * trainable + 16
  assert ("Memory on each of 2 devices (CPU:0, CPU:1): variables "
          f"{trainable / 1e6:.2f} MB, optimizer state") in proc.stderr
  assert "(optimizer state 2.0x the trainable weights)" in proc.stderr


def test_export_serves_predictions(finished_run, data_dir):
  model_dir, _ = finished_run
  loaded = tf.saved_model.load(os.path.join(model_dir, "export"))
  serve = loaded.signatures["serving_default"]
  from tfdist import digits
  images, labels = digits._split_arrays("test")
  out = serve(images=tf.constant(images / 255.0, tf.float32))
  assert out["probabilities"].shape == (len(labels), 10)
  accuracy = np.mean(out["classes"].numpy() == labels)
  assert accuracy >= 0.90


def test_resume_continues_at_saved_step(finished_run, data_dir):
  model_dir, _ = finished_run
  proc = run_cli(f"--model_dir={model_dir}", f"--data_dir={data_dir}",
                 "--flagfile=configs/mirrored_cpu2.cfg", "--train_steps=400")
  assert "Resumed from" in proc.stderr and "at step 300" in proc.stderr
  assert "step 300 -> 400" in proc.stderr
  assert "train step 350/400" in proc.stderr
  assert "train step 100/" not in proc.stderr
  assert artifacts.checkpoint_step(model_dir) == 400


def test_corrupt_latest_checkpoint_falls_back(tmp_path, data_dir):
  model_dir = str(tmp_path / "run")
  common = [f"--model_dir={model_dir}", f"--data_dir={data_dir}",
            "--steps_per_loop=10", "--log_every=10", "--checkpoint_every=10",
            "--eval_every=0", "--noexport"]
  run_cli(*common, "--train_steps=20")
  data_file = os.path.join(model_dir, "ckpt-20.data-00000-of-00001")
  with open(data_file, "r+b") as f:
    f.truncate(os.path.getsize(data_file) // 2)
  proc = run_cli(*common, "--train_steps=30")
  assert "ckpt-20 is unreadable" in proc.stderr
  assert "Resumed from" in proc.stderr and "at step 10" in proc.stderr
  assert artifacts.checkpoint_step(model_dir) == 30


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_trains(policy, tmp_path, data_dir):
  proc = run_cli(f"--model_dir={tmp_path / 'run'}", f"--data_dir={data_dir}",
                 "--model=cnn", f"--mixed_precision={policy}",
                 "--train_steps=200", "--eval_every=0", "--noexport")
  accuracy = float(proc.stdout.split("eval accuracy ")[1].split(",")[0])
  assert accuracy >= 0.9
