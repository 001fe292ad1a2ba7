"""What a Keras `fit` user expects of a trainer: run modes, Keras
callbacks, the best checkpoint and early stopping. Real runs on default,
mirrored, MultiWorkerMirrored and parameter servers; numbers checked."""

import csv
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import artifacts
from conftest import ROOT
from conftest import run_cli
from conftest import run_launcher

COMMON = ["--model=mlp", "--dataset=digits", "--batch_size=64",
          "--steps_per_loop=10", "--log_every=10", "--noexport"]
MIRRORED = ["--strategy=mirrored", "--num_cpu_devices=2"]


def _args(model_dir, data_dir, *extra):
  return [f"--model_dir={model_dir}", f"--data_dir={data_dir}", *COMMON,
          *extra]


def _final_evals(stdout):
  """{metric: value} of the 'Finished ...' or 'Evaluated ...' line."""
  line = [l for l in stdout.splitlines()
          if l.startswith(("Finished", "Evaluated"))][-1]
  return {name: float(value) for name, value in
          re.findall(r"eval (\w+) ([0-9.]+)", line)}


def _file_hashes(model_dir, skip=("eval",)):
  found = {}
  for directory, dirs, files in os.walk(model_dir):
    dirs[:] = [d for d in dirs if os.path.relpath(
        os.path.join(directory, d), model_dir) not in skip]
    for name in files:
      path = os.path.join(directory, name)
      with open(path, "rb") as f:
        found[os.path.relpath(path, model_dir)] = hashlib.sha256(
            f.read()).hexdigest()
  return found


# Run modes ----------------------------------------------------------------

@pytest.mark.parametrize("strategy", [[], MIRRORED], ids=["default",
                                                          "mirrored"])
def test_mode_eval_reproduces_the_runs_evals_and_changes_nothing(
    tmp_path, data_dir, strategy):
  model_dir = tmp_path / "run"
  trained = run_cli(*_args(model_dir, data_dir, *strategy,
                           "--train_steps=60", "--eval_every=30",
                           "--checkpoint_every=30", "--keep_checkpoints=5"))
  before = _file_hashes(model_dir)
  evaluated = run_cli(*_args(model_dir, data_dir, *strategy, "--mode=eval"))
  assert "Evaluated " in evaluated.stdout and "ckpt-60 (step 60)" in (
      evaluated.stdout)
  expected = _final_evals(trained.stdout)
  assert _final_evals(evaluated.stdout) == pytest.approx(expected, abs=1e-4)
  # An older checkpoint reproduces the eval the run made at its step.
  older = run_cli(*_args(model_dir, data_dir, *strategy, "--mode=eval",
                         f"--checkpoint={model_dir}/ckpt-30"))
  at_30 = dict(artifacts.scalars(str(model_dir / "eval"), "accuracy"))[30]
  assert _final_evals(older.stdout)["accuracy"] == pytest.approx(at_30,
                                                                 abs=1e-4)
  # Nothing but eval events changed, byte for byte.
  assert _file_hashes(model_dir) == before


def test_mode_eval_without_a_checkpoint_is_one_line(tmp_path, data_dir):
  proc = run_cli(*_args(tmp_path / "empty", data_dir, "--mode=eval"),
                 check=False)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].startswith("tfdist: error: "
                                                         "no checkpoint in")
  assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("strategy", [[], MIRRORED], ids=["default",
                                                          "mirrored"])
def test_mode_train_runs_no_eval(tmp_path, data_dir, strategy):
  model_dir = tmp_path / "run"
  proc = run_cli(*_args(model_dir, data_dir, *strategy, "--mode=train",
                        "--train_steps=40", "--eval_every=10"))
  assert "eval  step" not in proc.stderr
  assert "no eval (--mode=train)" in proc.stdout
  assert artifacts.checkpoint_step(str(model_dir)) == 40
  assert not (model_dir / "eval").exists()


def test_continuous_eval_follows_a_training_run(tmp_path, data_dir):
  model_dir = tmp_path / "run"
  follower = subprocess.Popen(
      [sys.executable, "-m", "tfdist.train",
       *_args(model_dir, data_dir, "--mode=continuous_eval",
              "--train_steps=60", "--sidecar_timeout=120")],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    run_cli(*_args(model_dir, data_dir, "--mode=train", "--train_steps=60",
                   "--checkpoint_every=20"))
    output, _ = follower.communicate(timeout=180)
  finally:
    follower.kill()
  assert follower.returncode == 0, output[-2000:]
  assert "Continuous eval: watching" in output
  evals = dict(artifacts.scalars(str(model_dir / "eval"), "accuracy"))
  assert 60 in evals
  once = run_cli(*_args(model_dir, data_dir, "--mode=eval"))
  assert _final_evals(once.stdout)["accuracy"] == pytest.approx(evals[60],
                                                                abs=1e-4)


def test_checkpoint_flag_outside_eval_mode_is_refused(tmp_path, data_dir):
  proc = run_cli(*_args(tmp_path / "run", data_dir, "--checkpoint=x"),
                 check=False)
  assert proc.returncode != 0 and "tfdist: error: --checkpoint" in (
      proc.stderr)
  assert not (tmp_path / "run").exists()


# Keras callbacks ------------------------------------------------------------

_CALLBACKS_MODULE = '''
import json
import keras


class Recorder(keras.callbacks.Callback):
  """Writes what tfdist called, in order, to a JSON file at the end."""

  def __init__(self, path):
    super().__init__()
    self.path, self.calls = path, []

  def on_train_begin(self, logs=None):
    self.calls.append(["train_begin"])

  def on_train_batch_end(self, batch, logs=None):
    self.calls.append(["batch", batch, sorted(logs)])

  def on_epoch_end(self, epoch, logs=None):
    self.calls.append(["epoch", epoch, sorted(logs)])

  def on_train_end(self, logs=None):
    self.calls.append(["train_end"])
    with open(self.path, "w") as f:
      json.dump(self.calls, f)


def early_stopping():
  return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=2),
          keras.callbacks.CSVLogger("{csv}"), Recorder("{record}")]


def schedule():
  # Sets the rate in on_epoch_begin, at the start and after each eval.
  return [keras.callbacks.LearningRateScheduler(
      lambda epoch, rate: 0.05 / (epoch + 1))]


def plateau():
  return [keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5,
                                            patience=0, min_delta=10.0)]


class _SigtermAt(keras.callbacks.Callback):
  """A preemption arriving after the train call that ends at `step`:
  the eval that follows agrees on it."""

  def __init__(self, step):
    super().__init__()
    self.step = step

  def on_train_batch_end(self, batch, logs=None):
    import os, signal
    if batch == self.step:
      os.kill(os.getpid(), signal.SIGTERM)


def sigterm_at_second_eval():
  return [_SigtermAt(20)]
'''


@pytest.fixture
def callbacks_module(tmp_path):
  """A user module outside the repo; returns (dir, csv path, record path)."""
  outside = tmp_path / "user"
  outside.mkdir()
  csv_path, record = tmp_path / "log.csv", tmp_path / "calls.json"
  (outside / "mycallbacks.py").write_text(textwrap.dedent(
      _CALLBACKS_MODULE).replace("{csv}", str(csv_path)).replace(
          "{record}", str(record)))
  return outside, csv_path, record


def _with_path(outside):
  return {"PYTHONPATH": f"{outside}{os.pathsep}{ROOT}"}


def _check_early_stopped(model_dir, csv_path, record, output):
  """EarlyStopping(patience=2) with a learning rate of 0: the first eval
  sets the best, two more without improvement stop the run: 3 evals, at
  steps 10, 20 and 30, then a checkpoint at step 30."""
  assert "Finished at step 30/100" in output, output[-3000:]
  assert artifacts.checkpoint_step(str(model_dir)) == 30
  rows = list(csv.DictReader(open(csv_path)))
  assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
  assert len({r["val_loss"] for r in rows}) == 1  # Nothing trained.
  calls = json.load(open(record))
  assert calls[0] == ["train_begin"] and calls[-1] == ["train_end"]
  batches = [c[1] for c in calls if c[0] == "batch"]
  assert batches == [10, 20, 30]
  epochs = [c for c in calls if c[0] == "epoch"]
  assert [c[1] for c in epochs] == [0, 1, 2]
  assert {"val_loss", "val_accuracy", "loss", "accuracy"} <= set(
      epochs[0][2])


def test_keras_early_stopping_csv_logger_and_user_callback(
    tmp_path, data_dir, callbacks_module):
  outside, csv_path, record = callbacks_module
  model_dir = tmp_path / "run"
  proc = run_cli(*_args(model_dir, data_dir, "--train_steps=100",
                        "--eval_every=10", "--learning_rate=0",
                        "--callbacks=mycallbacks:early_stopping"),
                 env=_with_path(outside))
  _check_early_stopped(model_dir, csv_path, record, proc.stdout)
  assert "A callback set model.stop_training at step 30" in proc.stderr


def test_an_early_stop_decided_in_a_preempted_eval_holds_on_resume(
    tmp_path, data_dir, callbacks_module):
  """--early_stopping_patience=1 with a learning rate of 0: the eval of
  step 20 decides to stop, and a SIGTERM arrives during it. The run
  saves at step 20 and exits 42; the resumed run stops there, as the
  uninterrupted one did, where it once trained to step 30."""
  outside, _, _ = callbacks_module
  model_dir = tmp_path / "run"
  args = _args(model_dir, data_dir, "--train_steps=100", "--eval_every=10",
               "--learning_rate=0", "--best_metric=accuracy",
               "--early_stopping_patience=1")
  first = run_cli(*args, "--callbacks=mycallbacks:sigterm_at_second_eval",
                  env=_with_path(outside), check=False)
  assert first.returncode == 42, first.stderr[-3000:]
  assert "Early stopping at step 20" in first.stderr, first.stderr[-3000:]
  assert artifacts.checkpoint_step(str(model_dir)) == 20
  resumed = run_cli(*args, env=_with_path(outside))
  assert ("Early stopping was decided at the eval of step 20, before this "
          "run resumed: not training further.") in resumed.stderr, \
      resumed.stderr[-3000:]
  assert "Finished at step 20/100" in resumed.stdout, resumed.stdout[-3000:]
  assert artifacts.checkpoint_step(str(model_dir)) == 20


def test_keras_early_stopping_on_two_workers(tmp_path, data_dir,
                                             callbacks_module):
  """The chief runs the callbacks; the stop reaches the other worker."""
  outside, csv_path, record = callbacks_module
  model_dir = tmp_path / "run"
  env = {**os.environ, **_with_path(outside)}
  proc = subprocess.run(
      [sys.executable, "-m", "launch.local", "--workers=2", "--",
       *_args(model_dir, data_dir, "--strategy=multi_worker_mirrored",
              "--train_steps=100", "--eval_every=10", "--learning_rate=0",
              "--callbacks=mycallbacks:early_stopping")],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:]
  for worker in ("worker:0", "worker:1"):
    assert f"{worker} | Finished at step 30/100" in proc.stdout
  _check_early_stopped(model_dir, csv_path, record,
                       proc.stdout.replace("worker:0 | ", ""))


def test_callbacks_and_best_checkpoint_on_parameter_servers(
    tmp_path, data_dir, callbacks_module):
  """The coordinator runs the callbacks and keeps the best; its eval is
  exact, so with a learning rate of 0 the evals repeat: the first is the
  best, and EarlyStopping(patience=2) stops at the third."""
  outside, csv_path, record = callbacks_module
  model_dir = tmp_path / "run"
  env = {**os.environ, **_with_path(outside)}
  proc = subprocess.run(
      [sys.executable, "-m", "launch.local", "--chief", "--workers=1",
       "--ps=1", "--",
       *_args(model_dir, data_dir, "--strategy=parameter_server",
              "--train_steps=100", "--eval_every=10", "--learning_rate=0",
              "--best_metric=accuracy",
              "--callbacks=mycallbacks:early_stopping")],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert "chief:0 | Finished at step 30/100" in proc.stdout
  assert [int(r["epoch"]) for r in csv.DictReader(open(csv_path))] == [
      0, 1, 2]
  # One call_end per log interval on PS (calls run on workers at once).
  assert [c[1] for c in json.load(open(record)) if c[0] == "batch"] == [
      10, 20, 30]
  kept = json.loads((model_dir / "best_checkpoint" / "best.json")
                    .read_text())
  assert kept["step"] == 10 and kept["evals_without_improvement"] == 2


def test_reduce_lr_on_plateau_sets_the_rate(tmp_path, data_dir,
                                            callbacks_module):
  outside, _, _ = callbacks_module
  model_dir = tmp_path / "run"
  run_cli(*_args(model_dir, data_dir, "--train_steps=40", "--eval_every=10",
                 "--learning_rate=0.008",
                 "--callbacks=mycallbacks:plateau"), env=_with_path(outside))
  rates = [v for k, v in artifacts.model_weights(str(model_dir)).items()
           if "learning_rate" in k]
  # min_delta=10: the first eval sets the best and every later one halves
  # the rate: at steps 20 and 30, before the checkpoint at step 40.
  assert len(rates) == 1 and rates[0] == pytest.approx(0.002)


def test_a_rate_set_at_epoch_begin_reaches_every_worker(
    tmp_path, data_dir, callbacks_module):
  """LearningRateScheduler on 2 MultiWorkerMirrored workers ends with
  the weights of the default strategy: the chief's rate reaches the other
  worker at each epoch's start, the first one included."""
  outside, _, _ = callbacks_module
  # SGD: Adam's moments would amplify the all-reduce's float rounding.
  train = ["--train_steps=30", "--eval_every=10", "--optimizer=sgd",
           "--learning_rate=0.001", "--callbacks=mycallbacks:schedule"]
  run_cli(*_args(tmp_path / "single", data_dir, *train),
          env=_with_path(outside))
  env = {**os.environ, **_with_path(outside)}
  proc = subprocess.run(
      [sys.executable, "-m", "launch.local", "--workers=2", "--",
       *_args(tmp_path / "mwms", data_dir, *train,
              "--strategy=multi_worker_mirrored",
              "--check_replicas_every=10")],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:]
  single = artifacts.model_weights(str(tmp_path / "single"))
  artifacts.assert_weights_close(
      artifacts.model_weights(str(tmp_path / "mwms")), single, rtol=1e-5)
  rates = [v for k, v in single.items() if "learning_rate" in k]
  assert rates == [pytest.approx(0.05 / 3)]  # Epoch 2 began at step 20.


def test_a_resumed_run_is_in_the_epoch_its_step_says(tmp_path, data_dir,
                                                     callbacks_module):
  """Trained to step 20, then resumed to 30: LearningRateScheduler sees
  epoch 2 at the resume, as the run that never stopped did (the rate in
  its last checkpoint is 0.05 / 3, not epoch 0's 0.05)."""
  outside, _, _ = callbacks_module
  train = ["--eval_every=10", "--optimizer=sgd", "--learning_rate=0.001",
           "--callbacks=mycallbacks:schedule"]
  for steps in (20, 30):
    run_cli(*_args(tmp_path / "run", data_dir, *train,
                   f"--train_steps={steps}"), env=_with_path(outside))
  rates = [v for k, v in artifacts.model_weights(
      str(tmp_path / "run")).items() if "learning_rate" in k]
  assert rates == [pytest.approx(0.05 / 3)]


def test_a_callback_that_cannot_work_is_one_line(tmp_path, data_dir):
  outside = tmp_path / "user"
  outside.mkdir()
  (outside / "bad.py").write_text(
      "import keras\n"
      "def make():\n"
      "  return [keras.callbacks.BackupAndRestore('/tmp/x')]\n")
  proc = run_cli(*_args(tmp_path / "run", data_dir,
                        "--callbacks=bad:make"), env=_with_path(outside),
                 check=False)
  assert proc.returncode != 0
  assert ("tfdist: error: keras.callbacks.BackupAndRestore cannot run under "
          "tfdist") in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(tmp_path / "run" / "checkpoint")


# Best checkpoint and early stopping ---------------------------------------

def _best_of(model_dir, metric, mode=max):
  evals = artifacts.scalars(str(model_dir / "eval"), metric)
  return mode(evals, key=lambda point: point[1])


def test_best_mode_auto_keeps_the_lowest_error(tmp_path):
  """mae is an error: auto keeps its smallest eval, not its largest."""
  model_dir = tmp_path / "run"
  run_cli(f"--model_dir={model_dir}", "--task=tests.user_regression:"
          "RegressionTask", "--train_steps=60", "--eval_every=10",
          "--steps_per_loop=10", "--log_every=10", "--noexport",
          "--best_metric=mae")
  kept = json.loads((model_dir / "best_checkpoint" / "best.json")
                    .read_text())
  lowest, highest = (_best_of(model_dir, "mae", mode)[0]
                     for mode in (min, max))
  assert lowest != highest  # The evals differ, so the check can fail.
  assert kept["mode"] == "min" and kept["step"] == lowest


def test_best_mode_auto_refuses_a_name_it_cannot_place(tmp_path):
  proc = run_cli(f"--model_dir={tmp_path / 'run'}", "--task=tests."
                 "user_regression:NamedMetricTask", "--train_steps=10",
                 "--eval_every=10", "--best_metric=score", check=False)
  assert proc.returncode != 0
  assert ("tfdist: error: --best_mode=auto cannot tell whether score is "
          "better lower or higher") in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "run").exists()


def test_a_best_export_a_preemption_left_is_written_on_resume(
    tmp_path, data_dir, callbacks_module):
  """The eval of step 20 is the best so far (the loss falls at a rate of
  0.1) and a SIGTERM arrives during it: the run keeps that best and saves
  at step 20, but leaves the best's export, which could outlast the
  grace, marked in best.json, and exits 42. The resumed run writes it
  from the restored weights before it trains on."""
  outside, _, _ = callbacks_module
  model_dir = tmp_path / "run"
  args = _args(model_dir, data_dir, "--train_steps=30", "--eval_every=10",
               "--learning_rate=0.1", "--best_metric=loss", "--export")
  first = run_cli(*args, "--callbacks=mycallbacks:sigterm_at_second_eval",
                  env=_with_path(outside), check=False)
  assert first.returncode == 42, first.stderr[-3000:]
  best_file = model_dir / "best_checkpoint" / "best.json"
  kept = json.loads(best_file.read_text())
  assert kept["step"] == kept["export_pending_at_step"] == 20, kept
  resumed = run_cli(*args, env=_with_path(outside))
  log = resumed.stderr
  written = log.index("Writing the export of the best eval (step 20), "
                      "which the previous run left unfinished.")
  assert written < log.index("Exported SavedModel to") < log.index(
      "Training"), log[-3000:]
  assert json.loads(best_file.read_text())["export_pending_at_step"] is None
  assert (model_dir / "best_export" / "saved_model.pb").exists()


@pytest.mark.parametrize("strategy", [[], MIRRORED], ids=["default",
                                                          "mirrored"])
def test_best_checkpoint_survives_keep_checkpoints_and_is_exported(
    tmp_path, data_dir, strategy):
  model_dir = tmp_path / "run"
  run_cli(*_args(model_dir, data_dir, *strategy, "--train_steps=80",
                 "--eval_every=10", "--learning_rate=0.05",
                 "--keep_checkpoints=1", "--best_metric=loss", "--export"))
  step, value = _best_of(model_dir, "loss", min)
  kept = json.loads((model_dir / "best_checkpoint" / "best.json")
                    .read_text())
  assert kept["step"] == step and kept["value"] == pytest.approx(value,
                                                                 rel=1e-6)
  assert kept["mode"] == "min"  # auto for a loss.
  assert os.path.exists(model_dir / "best_checkpoint" /
                        f"ckpt-{step}.index")
  assert (model_dir / "best_export" / "saved_model.pb").exists()
  again = run_cli(*_args(model_dir, data_dir, *strategy, "--mode=eval",
                         f"--checkpoint={model_dir}/best_checkpoint/"
                         f"ckpt-{step}"))
  assert _final_evals(again.stdout)["loss"] == pytest.approx(value, abs=1e-4)


def test_early_stopping_from_the_cli_on_two_workers(tmp_path, data_dir):
  model_dir = tmp_path / "run"
  proc = run_launcher(["--workers=2"], _args(
      model_dir, data_dir, "--strategy=multi_worker_mirrored",
      "--train_steps=100", "--eval_every=10", "--learning_rate=0",
      "--best_metric=accuracy", "--early_stopping_patience=2"))
  for worker in ("worker:0", "worker:1"):
    assert f"{worker} | Finished at step 30/100" in proc.stdout
  assert "Early stopping at step 30: no better accuracy in 2 evals" in (
      proc.stdout)
  kept = json.loads((model_dir / "best_checkpoint" / "best.json")
                    .read_text())
  assert kept["step"] == 10 and kept["evals_without_improvement"] == 2


def test_best_and_early_stopping_need_a_known_metric(tmp_path, data_dir):
  for extra, message in [
      (["--best_metric=f1"], "--best_metric must be an eval metric"),
      (["--early_stopping_patience=3"],
       "--early_stopping_patience needs --best_metric")]:
    proc = run_cli(*_args(tmp_path / "run", data_dir, *extra), check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "run" / "checkpoint")


def test_sidecar_early_stopping_stops_the_workers(tmp_path, data_dir):
  """Two MWMS workers train with no evals of their own; the sidecar
  evaluator keeps the best and, with a learning rate of 0, stops early
  after 2 evals without improvement. The workers stop together at their
  next checkpoint, and the sidecar's best is kept (theirs would clobber
  it)."""
  model_dir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "launch.local", "--workers=2", "--evaluator",
       "--", *_args(model_dir, data_dir, "--strategy=multi_worker_mirrored",
                    "--train_steps=100000", "--log_every=1000",
                    "--eval_every=0", "--checkpoint_every=200",
                    "--learning_rate=0", "--best_metric=accuracy",
                    "--early_stopping_patience=2")],
      cwd=ROOT, capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stdout[-3000:]
  kept = json.loads((model_dir / "best_checkpoint" / "best.json")
                    .read_text())
  assert kept["evals_without_improvement"] == 2
  stopped_at = kept["early_stopped_at_step"]
  assert stopped_at > kept["step"] and stopped_at % 200 == 0
  assert os.path.exists(model_dir / "best_checkpoint" /
                        f"ckpt-{kept['step']}.index")
  finished = [int(s) for s in re.findall(
      r"worker:\d \| Finished at step (\d+)/100000", proc.stdout)]
  assert len(finished) == 2 and finished[0] == finished[1]
  assert stopped_at < finished[0] < 100000 and finished[0] % 200 == 0
  assert artifacts.checkpoint_step(str(model_dir)) == finished[0]
  assert "evaluator:0 | " in proc.stdout and (
      f"The sidecar evaluator stopped early at step {stopped_at}"
      in proc.stdout)


def test_a_summed_variable_under_replicas_is_named_in_one_warning(
    tmp_path, data_dir):
  """Keras 3 assigns v + delta on every replica, and aggregation="sum"
  adds the assigns: the count grows by the replica count times itself.
  tfdist names the variable and says what to use; one replica is quiet."""
  warnings = {}
  for name, strategy in (("mirrored", MIRRORED),
                         ("default", ["--strategy=default"])):
    proc = run_cli(*_args(tmp_path / name, data_dir, "--train_steps=2",
                          "--model=tests.summed_counter:build", *strategy))
    warnings[name] = [l for l in proc.stderr.splitlines()
                      if "aggregation=\"sum\"" in l]
  assert len(warnings["mirrored"]) == 1, warnings
  assert "examples_seen" in warnings["mirrored"][0]
  assert "under 2 replicas" in warnings["mirrored"][0]
  assert "only_first_replica" in warnings["mirrored"][0]
  assert warnings["default"] == []
