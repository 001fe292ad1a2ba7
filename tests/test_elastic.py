"""Elastic MultiWorkerMirrored jobs on the local launcher
(--workers=MIN:MAX), with real processes: a worker lost for good is
dropped, a discovery script that offers a slot adds one, and below MIN
the job stops in one line. Each change restarts the group from the
checkpoint; the weights are checked against one device's."""

import os
import re
import signal

import numpy as np
import pytest

import artifacts
from conftest import LauncherProcess
from conftest import run_cli
from conftest import run_launcher

# A global batch of 48 divides by 2 and 3 workers, and tfdist's global
# batch k is the same examples for any worker count: every membership
# trains the weights one device would (up to rounding, which a smooth model
# does not amplify).
COMMON = ["--model=tests.smooth_model:mlp_tanh", "--steps_per_loop=5",
          "--log_every=5", "--eval_every=0", "--batch_size=48",
          "--optimizer=sgd", "--learning_rate=0.05",
          "--checkpoint_every=10", "--noexport"]
LAUNCH = ["--backoff_seconds=0.2", "--stop_grace_seconds=5",
          "--isolate=off"]


def train_args(model_dir, data_dir, steps):
  return [f"--model_dir={model_dir}", f"--data_dir={data_dir}",
          f"--train_steps={steps}", *COMMON]


def assert_one_device_weights(model_dir, tmp_path, data_dir, steps):
  """The run's trainable weights are one device's, up to rounding. Replicas
  sum in another order than one device, and a CPU with other vector units
  rounds otherwise (AVX-512 moved a bias by 2.6e-6 after 150 steps), so the
  bound is 2% of one step's move (norm over the trainable weights): a batch
  skipped or repeated moves them by about a whole step's."""
  reference = tmp_path / "one_device"
  run_cli(*train_args(reference, data_dir, steps), "--strategy=default")
  ours = _trainable(artifacts.model_weights(str(model_dir)))
  theirs = _trainable(artifacts.model_weights(str(reference)))
  earlier = _trainable(artifacts.model_weights(
      str(reference), checkpoint=str(reference / f"ckpt-{steps - 10}")))
  assert ours.keys() == theirs.keys() and theirs
  one_step = _distance(theirs, earlier) / 10
  assert _distance(ours, theirs) < 0.02 * one_step, (
      _distance(ours, theirs), one_step)


def _trainable(weights):
  return {k: v for k, v in weights.items() if "_trainable_variables" in k}


def _distance(a, b):
  return float(np.sqrt(sum(np.sum(np.square(a[k] - b[k])) for k in a)))


def _resumed_with(output, workers):
  """The step the chief resumed from after the change to `workers`."""
  after = output.split(f"-> {workers} workers", 1)[1]
  return int(re.findall(r"worker:0 \| .*Resumed from .* at step (\d+)",
                        after)[0])


def _kill_when(workers, model_dir, data_dir, steps, seen, victim):
  """An elastic MWMS job with no restarts; `victim` gets SIGKILL once the
  chief printed `seen`. Returns (exit code, output)."""
  run = LauncherProcess(
      [f"--workers={workers}", "--max_restarts=0", *LAUNCH],
      [*train_args(model_dir, data_dir, steps),
       "--strategy=multi_worker_mirrored"])
  run.wait_for(lambda l: l.startswith("worker:0") and seen in l)
  os.kill(run.pids[victim], signal.SIGKILL)
  return run.finish()


@pytest.mark.serial
def test_shrink_drops_a_lost_worker_and_finishes_exactly(tmp_path,
                                                         data_dir):
  model_dir = tmp_path / "run"
  # Between checkpoints (every 10 steps): the survivors' state is newer.
  code, output = _kill_when("2:3", model_dir, data_dir, 60,
                            "train step 25/", "worker:2")
  assert code == 0, output[-3000:]
  assert re.search(r"membership change: 3 -> 2 workers \(worker:2 exited "
                   r"with code -9 with no restarts left\)", output)
  # No step redone: the new group starts where the old one last logged.
  assert _resumed_with(output, 2) >= 25
  assert re.search(r"Resumed from \S+/survivors/worker-[01]/ckpt-", output)
  assert "worker:2 |" not in output.split("-> 2 workers", 1)[1]
  assert "worker:0 | Finished at step 60/60" in output
  assert artifacts.checkpoint_step(str(model_dir)) == 60
  # Two starts, as TensorBoard shows them: 3 workers, then 2.
  sizes = [v for _, v in artifacts.scalars(
      str(model_dir / "train"), "workers", in_time_order=True)]
  assert sizes == [3, 2]
  assert_one_device_weights(model_dir, tmp_path, data_dir, 60)


@pytest.mark.serial
def test_grow_adds_the_worker_discovery_offers(tmp_path, data_dir):
  slots = tmp_path / "slots"
  slots.write_text("localhost:2\n")
  model_dir = tmp_path / "run"
  run = LauncherProcess(
      ["--workers=1:3", f"--host_discovery=cat {slots}",
       "--discovery_seconds=0.5", *LAUNCH],
      [*train_args(model_dir, data_dir, 600),
       "--strategy=multi_worker_mirrored"])
  # 600 steps: the smooth model trained the 60 steps after ckpt-20 before
  # discovery (every 0.5 s) saw the third slot (CI, 2026-12-07).
  run.wait_for(lambda l: l.startswith("worker:0") and "ckpt-20." in l)
  slots.write_text("localhost:2\n127.0.0.1:1\n")
  code, output = run.finish()
  assert code == 0, output[-3000:]
  assert "offers 2 worker slot(s): starting with 2 workers" in output
  assert "membership change: 2 -> 3 workers" in output
  assert "preempted (SIGTERM): checkpoint saved at" in output
  assert _resumed_with(output, 3) >= 20
  assert "worker:0 | Finished at step 600/600" in output
  assert_one_device_weights(model_dir, tmp_path, data_dir, 600)


@pytest.mark.serial
def test_below_min_stops_in_one_line(tmp_path, data_dir):
  code, output = _kill_when("2:2", tmp_path / "run", data_dir, 100000,
                            "ckpt-10.", "worker:1")
  assert code != 0
  stops = [l for l in output.splitlines() if "below the minimum" in l]
  assert stops == ["[launch] worker:1 exited with code -9 with no restarts "
                   "left, and 1 worker(s) would be below the minimum of 2 "
                   "(--workers=MIN:MAX). Training did not finish."]
  assert "Traceback" not in output


def test_bad_elastic_flags_are_one_line(tmp_path):
  flagfile = tmp_path / "flags.cfg"
  flagfile.write_text("--batch_size=49\n")
  batch64 = ["--batch_size=64"]
  for flags, train, expected in (
      (["--workers=3:2"], batch64, "--workers=MIN:MAX needs 1 <= MIN <= MAX"),
      (["--workers=0:2"], batch64, "--workers=MIN:MAX needs 1 <= MIN <= MAX"),
      (["--workers=2", "--host_discovery=true"], batch64,
       "--host_discovery needs --workers=MIN:MAX"),
      (["--workers=2:4"], batch64, "--workers=2:4 keeps the global batch, "
       "which 3 worker(s) cannot split. Received: batch_size=64"),
      # The default batch, a flagfile's, the chief and each task's
      # replicas count too.
      (["--workers=2:3"], [], "which 3 worker(s) cannot split. Received: "
       "batch_size=64"),
      (["--workers=2:3"], [f"--flagfile={flagfile}"],
       "which 2, 3 worker(s) cannot split. Received: batch_size=49"),
      # absl's "--name value" form is read too (not the default 64).
      (["--workers=2:3"], ["--batch_size", "49"],
       "which 2, 3 worker(s) cannot split. Received: batch_size=49"),
      # And its one-dash forms, in the flags and in a flagfile.
      (["--workers=2:3"], ["-batch_size", "49"],
       "which 2, 3 worker(s) cannot split. Received: batch_size=49"),
      (["--workers=2:3"], [f"-flagfile={flagfile}", "-batch_size=64"],
       "which 3 worker(s) cannot split. Received: batch_size=64"),
      (["--workers=2:3"], ["-flagfile", str(flagfile)],
       "which 2, 3 worker(s) cannot split. Received: batch_size=49"),
      (["--chief", "--workers=1:2"], batch64, "which 2 worker(s) and the "
       "chief cannot split. Received: batch_size=64"),
      (["--workers=1:2"], [*batch64, "--num_cpu_devices=3"], "which 1, 2 "
       "worker(s) of 3 replicas each cannot split"),
      (["--chief", "--workers=1:2", "--ps=1", "--host_discovery=true"],
       batch64, "--host_discovery cannot grow a parameter-server job")):
    proc = run_launcher(flags, [f"--model_dir={tmp_path / 'x'}", *train],
                        check=False, timeout=60)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
  assert not (tmp_path / "x").exists()


def test_an_error_every_task_reports_ends_the_job(tmp_path):
  """A bad flag fails every task alike: that is the job's error, not a
  lost worker, so nothing restarts, shrinks or grows back."""
  slots = tmp_path / "slots"
  slots.write_text("localhost:2\n")
  for flags in (["--workers=2", "--max_restarts=3"],
                ["--workers=1:2", "--max_restarts=0",
                 f"--host_discovery=cat {slots}", "--discovery_seconds=1"]):
    proc = run_launcher(
        [*flags, "--backoff_seconds=0.1"],
        # Refused before TensorFlow loads (tests/test_cli_errors.py), so
        # no task pays its import to fail.
        [f"--model_dir={tmp_path / 'x'}", "--train_steps=0",
         "--strategy=multi_worker_mirrored"], check=False, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert ("every training task exited with code 2: an error of the job"
            in output), output
    assert "restarting the job" not in output
    assert "membership change" not in output


def test_a_worker_that_fails_each_time_it_is_offered_ends_the_job(
    tmp_path):
  """Discovery offers worker 1's slot again after each drop, and worker 1
  dies at once each time: the changes back off, and after
  MAX_MEMBERSHIP_CHANGES the job stops in one line instead of cycling
  for ever."""
  from launch import membership  # pylint: disable=g-import-not-at-top
  slots = tmp_path / "slots"
  slots.write_text("localhost:2\n")
  proc = run_launcher(
      ["--workers=1:2", "--max_restarts=0", "--backoff_seconds=0.001",
       f"--host_discovery=cat {slots}", "--discovery_seconds=0.2",
       "--module=tests.flaky_worker", "--stop_grace_seconds=5"],
      [f"--model_dir={tmp_path / 'x'}"], check=False, timeout=120)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 1, output[-3000:]
  changes = output.count("membership change: ")
  assert changes == membership.MAX_MEMBERSHIP_CHANGES, output[-3000:]
  assert "the new group starts in" in output  # It backed off.
  assert (f"{membership.MAX_MEMBERSHIP_CHANGES + 1} membership changes "
          "within 60 "
          "minutes") in output and "does not hold together" in output
