"""ParameterServerStrategy on Keras 3, with real processes on 127.0.0.1:
1 chief, 2 workers, 1 ps (2 ps for sharding), on a 2-core machine."""

import os
import re
import signal

import pytest

import artifacts
from conftest import LauncherProcess
from conftest import long_test
from conftest import run_launcher

PS = ["--strategy=parameter_server", "--eval_every=0"]
CLUSTER = ["--chief", "--workers=2", "--ps=1"]


def _args(model_dir, data_dir, *extra):
  return [f"--model_dir={model_dir}", f"--data_dir={data_dir}", *PS, *extra]


@pytest.fixture(scope="module")
def ps_run(tmp_path_factory, data_dir):
  """One job checked for its accuracy and for its sidecar evaluator: 1
  chief, 2 workers, 1 ps and an evaluator, 300 steps of the mlp."""
  model_dir = str(tmp_path_factory.mktemp("ps") / "run")
  proc = run_launcher([*CLUSTER, "--evaluator"], [
      f"--model_dir={model_dir}", f"--data_dir={data_dir}",
      "--strategy=parameter_server", "--model=mlp", "--dataset=digits",
      "--batch_size=64", "--train_steps=300"])
  return model_dir, proc


def test_trains_to_accuracy_with_an_exact_step(ps_run):
  model_dir, proc = ps_run
  accuracy = float(re.search(r"chief:0 \| Finished at step 300/300 .* eval "
                             r"accuracy ([0-9.]+)", proc.stdout).group(1))
  assert accuracy >= 0.90
  assert artifacts.checkpoint_step(model_dir) == 300
  assert artifacts.scalars(os.path.join(model_dir, "train"), "loss")[-1][0] \
      == 300
  # ps and worker tasks serve until the chief is done; then they are
  # not needed (they exit once its port is gone, or the launcher stops them).
  assert re.search(r"worker:1 \| \S+ Serving as worker:1", proc.stdout)
  assert "training finished" in proc.stdout


@pytest.mark.serial
def test_killed_worker_restarts_alone_and_run_ends_at_requested_step(
    tmp_path, data_dir):
  # test_launcher_core.py checks the restart-alone policy with scripted
  # tasks in seconds; this is the same with TensorFlow.
  long_test("about 50 s")
  model_dir = str(tmp_path / "run")
  run = LauncherProcess(
      [*CLUSTER, "--max_restarts=2", "--backoff_seconds=0.2"],
      _args(model_dir, data_dir, "--train_steps=3000", "--steps_per_loop=20",
            "--log_every=200", "--checkpoint_every=1000"))
  run.wait_for(lambda l: "train step 400/3000" in l)
  os.kill(run.pids["worker:1"], signal.SIGKILL)
  code, output = run.finish()
  assert code == 0, output[-3000:]
  assert "worker:1 exited with code -9; restarting it alone" in output
  assert "restarting the job" not in output
  assert "chief:0 | " in output and "Finished at step 3000/3000" in output
  assert artifacts.checkpoint_step(model_dir) == 3000


@pytest.mark.serial
def test_losing_a_worker_without_restarts_is_not_fatal(tmp_path, data_dir):
  """No --max_restarts: the job carries on with the other worker, ends at
  the exact step, and leaves no scratch directory behind."""
  # A headline guarantee: in the default CI (about 45 s).
  model_dir = str(tmp_path / "run")
  scratch = tmp_path / "tmp"
  scratch.mkdir()
  run = LauncherProcess(
      CLUSTER, _args(model_dir, data_dir, "--train_steps=3000",
                     "--steps_per_loop=20", "--log_every=200",
                     "--checkpoint_every=1000"),
      env={"TMPDIR": str(scratch)})
  run.wait_for(lambda l: "train step 400/3000" in l)
  os.kill(run.pids["worker:1"], signal.SIGKILL)
  code, output = run.finish()
  assert code == 0, output[-3000:]
  assert ("worker:1 exited with code -9 and has no restarts left; the job "
          "carries on without it (worker:0 left)") in output
  assert "Finished at step 3000/3000" in output
  assert artifacts.checkpoint_step(model_dir) == 3000
  assert list(scratch.iterdir()) == []


@pytest.mark.serial
def test_losing_every_worker_checkpoints_and_stops(tmp_path, data_dir):
  model_dir = str(tmp_path / "run")
  run = LauncherProcess(
      CLUSTER, _args(model_dir, data_dir, "--train_steps=100000",
                     "--steps_per_loop=20", "--log_every=200",
                     "--checkpoint_every=100000"))
  run.wait_for(lambda l: "train step 400/100000" in l)
  os.kill(run.pids["worker:0"], signal.SIGKILL)
  run.wait_for(lambda l: "carries on without it" in l)
  os.kill(run.pids["worker:1"], signal.SIGKILL)
  code, output = run.finish()
  assert code != 0
  assert "every worker is gone; asking the chief to checkpoint" in output
  saved = re.search(r"checkpoint saved at step (\d+)", output)
  assert saved, output[-3000:]
  assert artifacts.checkpoint_step(model_dir) == int(saved.group(1)) >= 400


@pytest.mark.serial
def test_killed_ps_restarts_job_from_checkpoint(tmp_path, data_dir):
  model_dir = str(tmp_path / "run")
  run = LauncherProcess(
      [*CLUSTER, "--max_restarts=2", "--backoff_seconds=0.2",
       "--stop_grace_seconds=5"],
      _args(model_dir, data_dir, "--train_steps=2000", "--steps_per_loop=20",
            "--log_every=200", "--checkpoint_every=500"))
  run.wait_for(lambda l: "ckpt-500." in l)
  os.kill(run.pids["ps:0"], signal.SIGKILL)
  code, output = run.finish()
  assert code == 0, output[-3000:]
  assert "ps:0 exited with code -9; restarting the job" in output
  resumed = re.findall(r"Resumed from .*ckpt-(\d+) at step", output)
  assert resumed and int(resumed[0]) >= 500
  assert artifacts.checkpoint_step(model_dir) == 2000


@pytest.mark.serial
def test_sigterm_to_chief_writes_checkpoint(tmp_path, data_dir):
  model_dir = str(tmp_path / "run")
  run = LauncherProcess(
      CLUSTER, _args(model_dir, data_dir, "--train_steps=100000",
                     "--steps_per_loop=20", "--log_every=200",
                     "--checkpoint_every=0"))
  run.wait_for(lambda l: "train step 400/" in l)
  os.kill(run.pids["chief:0"], signal.SIGTERM)
  line = run.wait_for(lambda l: "preempted (SIGTERM): checkpoint saved" in l)
  step = int(re.search(r"at step (\d+)", line).group(1))
  assert step >= 400
  assert artifacts.checkpoint_step(model_dir) == step
  # A preemption uses no restart (none are allowed here): the job resumes.
  run.wait_for(lambda l: f"Resumed from {model_dir}/ckpt-{step} at step "
               f"{step}" in l)
  run.proc.send_signal(signal.SIGTERM)
  code, output = run.finish()
  assert code == 128 + signal.SIGTERM, output[-2000:]
  assert "resuming the job (a preemption uses no restart)" in output


def test_embedding_is_sharded_across_ps_tasks(tmp_path, data_dir):
  """The sidecar evaluator builds the same shards, so it restores them
  and its eval equals the chief's."""
  proc = run_launcher(
      ["--chief", "--workers=1", "--ps=2", "--evaluator"],
      _args(tmp_path / "run", data_dir, "--model=embedding_bag",
            "--train_steps=100", "--ps_shard_min_bytes=262144"))
  sidecar = re.search(r"evaluator:0 \| .*eval  step 100: (.*examples\))",
                      proc.stdout)
  chief = re.search(r"chief:0 \| .*eval  step 100: (.*examples\))",
                    proc.stdout)
  assert sidecar and chief and sidecar.group(1) == chief.group(1), (
      proc.stdout[-3000:])
  placement = dict(re.findall(r"placement (ps:\d): \d+ bytes in \d+ "
                              r"variable\(s\): (.*)", proc.stdout))
  assert set(placement) == {"ps:0", "ps:1"}
  assert "embedding/shard_0_of_2" in placement["ps:0"]
  assert "embedding/shard_1_of_2" in placement["ps:1"]
  assert "Finished at step 100/100" in proc.stdout


def test_sidecar_evaluator_is_exact_and_outside_the_cluster(ps_run):
  model_dir, proc = ps_run
  assert "Sidecar evaluator done at step 300" in proc.stdout
  sidecar = re.search(r"evaluator:0 \| .*eval  step 300: (accuracy [0-9.]+ "
                      r"+loss [0-9.]+ +\(359 examples\))", proc.stdout)
  chief = re.search(r"chief:0 \| .*eval  step 300: (accuracy [0-9.]+ +loss "
                    r"[0-9.]+ +\(359 examples\))", proc.stdout)
  assert sidecar and chief and sidecar.group(1) == chief.group(1)
  assert "evaluator:0 | " in proc.stdout
  assert "Strategy: default (sidecar evaluator)" in proc.stdout
  steps = [s for s, _ in artifacts.scalars(os.path.join(model_dir, "eval"),
                                           "accuracy")]
  # The chief's eval at 300 and the sidecar's, each in its own event file.
  assert steps.count(300) == 2, steps
