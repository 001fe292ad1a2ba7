"""MultiWorkerMirrored with real processes on 127.0.0.1, started by our
own launcher: failures, preemption, replica checks, gradient compression."""

import glob
import os
import re
import signal
import sys
import time

import pytest

import artifacts
from conftest import LauncherProcess
from conftest import process_alive
from conftest import run_launcher
from tfdist.errors import PEER_LOST_EXIT_CODE

MWMS = ["--strategy=multi_worker_mirrored", "--steps_per_loop=10",
        "--log_every=100", "--eval_every=0"]


def _train_args(model_dir, data_dir, *extra):
  return [f"--model_dir={model_dir}", f"--data_dir={data_dir}", *MWMS,
          *extra]


@pytest.mark.serial
def test_sigkilled_worker_restarts_job_and_finishes(tmp_path, data_dir):
  model_dir = str(tmp_path / "run")
  run = LauncherProcess(
      ["--workers=2", "--max_restarts=2", "--backoff_seconds=0.2",
       "--stop_grace_seconds=3"],
      _train_args(model_dir, data_dir, "--train_steps=500",
                  "--checkpoint_every=1000"))
  # No checkpoint before the end: what the restart resumes from is the
  # survivor's state.
  run.wait_for(lambda l: "train step 200/500" in l and
               l.startswith("worker:0"))
  os.kill(run.pids["worker:1"], signal.SIGKILL)
  code, output = run.finish()
  assert code == 0, output[-3000:]
  assert "worker:1 exited with code -9; restarting the job" in output
  before, after = output.split("restarting the job", 1)
  # The survivor kept the state of its last call that ended: the restart
  # redoes none of the steps logged before it.
  last = max(int(s) for s in re.findall(r"worker:0 \| .*train step (\d+)/",
                                        before))
  resumed = re.findall(r"worker:0 \| .*Resumed from (\S+) at step (\d+)",
                       after)
  assert "/survivors/" in resumed[0][0] and int(resumed[0][1]) >= last
  assert "no step is redone" in after
  assert "Finished at step 500/500" in output
  assert artifacts.checkpoint_step(model_dir) == 500
  assert not os.path.exists(os.path.join(model_dir, "survivors"))
  # The restarted tasks were warm spares; no spare outlives the launcher.
  for task in ("worker:0", "worker:1"):
    assert re.search(rf"started {task} pid=\d+ at \S+ \(attempt 2, a warm "
                     r"spare\)", output), output[-3000:]
  spares = [int(p) for line in re.findall(r"warm spares waiting for a "
                                          r"restart's tasks: pids (.*)",
                                          output)
            for p in line.split(", ")]
  assert len(spares) == 4, output[-3000:]
  assert not any(process_alive(pid) for pid in spares)


@pytest.mark.serial
def test_sigterm_saves_current_step_then_resumes(tmp_path, data_dir,
                                                 gce_metadata):
  """On a machine that looks like a GCE CPU VM (a metadata server that
  answers), where TF's own preemption handler stops acting on SIGTERM; with
  no restarts allowed, since a preemption uses none."""
  model_dir = str(tmp_path / "run")
  run = LauncherProcess(
      ["--workers=2", "--max_restarts=0", "--backoff_seconds=0.2",
       "--stop_grace_seconds=10", "--isolate=off"],
      _train_args(model_dir, data_dir, "--train_steps=700",
                  "--checkpoint_every=500"),
      env={"GCE_METADATA_IP": gce_metadata})
  run.wait_for(lambda l: "train step 100/700" in l)
  os.kill(run.pids["worker:1"], signal.SIGTERM)
  saved = run.wait_for(lambda l: "preempted (SIGTERM): checkpoint saved at "
                       "step" in l and l.startswith("worker:0"))
  step = int(re.search(r"at step (\d+)", saved).group(1))
  assert 100 <= step < 500  # Not a periodic checkpoint: the current step.
  assert os.path.exists(os.path.join(model_dir, f"ckpt-{step}.index"))
  code, output = run.finish()
  assert code == 0, output[-3000:]
  assert ("was preempted and saved a checkpoint; resuming the job (a "
          "preemption uses no restart)") in output
  assert f"Resumed from {model_dir}/ckpt-{step} at step {step}" in output
  assert artifacts.checkpoint_step(model_dir) == 700


def test_replica_check_names_the_perturbed_worker(tmp_path, data_dir):
  proc = run_launcher(
      ["--workers=2", "--module=tests.perturb_worker"],
      _train_args(tmp_path / "run", data_dir, "--train_steps=40",
                  "--check_replicas_every=10"), check=False)
  assert proc.returncode == 4, proc.stdout[-3000:]
  assert ("replica check at step 10: worker 1 (replica 1) diverged from "
          "replica 0 in 1 variable(s): dense_0/kernel") in proc.stdout


def test_replica_check_passes_on_a_healthy_run(tmp_path, data_dir):
  """Also runs the ring and packing communication options."""
  proc = run_launcher(
      ["--workers=2"], _train_args(tmp_path / "run", data_dir,
                                   "--train_steps=40",
                                   "--check_replicas_every=10",
                                   "--all_reduce_alg=ring",
                                   "--bytes_per_pack=65536"))
  assert "Finished at step 40/40" in proc.stdout
  assert "replica check" not in proc.stdout


def _final_accuracy(output):
  found = re.search(r"worker:0 \| Finished .* eval accuracy ([0-9.]+)",
                    output)
  return float(found.group(1))


def test_float16_allreduce_trains_to_the_same_accuracy(tmp_path, data_dir):
  results = {}
  for dtype in ("float32", "float16"):
    model_dir = tmp_path / dtype
    proc = run_launcher(["--workers=2"], _train_args(
        model_dir, data_dir, "--train_steps=300",
        f"--allreduce_dtype={dtype}"))
    results[dtype] = (_final_accuracy(proc.stdout),
                      artifacts.model_weights(str(model_dir)))
  assert results["float32"][0] >= 0.9
  assert abs(results["float16"][0] - results["float32"][0]) <= 0.01
  # The compressed path really ran: the weights are not bit-identical.
  key = artifacts.FIRST_KERNEL
  assert (results["float16"][1][key] != results["float32"][1][key]).any()


@pytest.mark.serial
def test_stalled_worker_gives_an_error_naming_it(tmp_path, data_dir):
  run = LauncherProcess(
      ["--workers=2", "--stop_grace_seconds=2"],
      _train_args(tmp_path / "run", data_dir, "--train_steps=100000",
                  "--collective_timeout=5", "--checkpoint_every=0"))
  run.wait_for(lambda l: "train step 200/" in l)
  stalled = run.pids["worker:1"]
  os.kill(stalled, signal.SIGSTOP)
  try:
    code, output = run.finish(timeout=120)
  finally:
    if process_alive(stalled):
      os.kill(stalled, signal.SIGCONT)
  # A lost peer has its own exit code: never taken for a job's error.
  assert code == PEER_LOST_EXIT_CODE, output[-3000:]
  # tfdist's stall watch named the peer before TF's own timeout began its
  # abort, which now and then crashes the process (tfdist/stall_watch.py).
  assert "StartAbort" not in output, output[-3000:]
  assert re.search(r"worker:0 \| tfdist: error: a collective on worker:0 "
                   r"timed out \(--collective_timeout\): a peer stopped "
                   r"answering. Peers: worker:1 \(127.0.0.1:\d+\)", output)


@pytest.mark.serial
def test_ctrl_c_stops_every_task(tmp_path, data_dir):
  run = LauncherProcess(
      ["--workers=2", "--stop_grace_seconds=10"],
      _train_args(tmp_path / "run", data_dir, "--train_steps=100000",
                  "--checkpoint_every=0"))
  run.wait_for(lambda l: "train step 100/" in l)
  pids = dict(run.pids)
  run.proc.send_signal(signal.SIGINT)
  code, output = run.finish(timeout=120)
  assert code == 128 + signal.SIGINT, output[-2000:]
  assert "stopped by signal" in output
  deadline = time.monotonic() + 10
  while (any(process_alive(p) for p in pids.values()) and
         time.monotonic() < deadline):
    time.sleep(0.2)
  assert not any(process_alive(p) for p in pids.values())


def test_a_peer_lost_while_the_trainer_is_built_is_one_line(tmp_path,
                                                            data_dir):
  """Worker 1 dies while its model is built; worker 0, in the
  collectives that give the variables their first values, ends with the
  lost-peer line and code when TF's coordination service finds worker 1
  gone (about 10 s), not a traceback nor a line that blames the model,
  and writes no checkpoint."""
  from test_collectives import _two_workers
  model_dir = tmp_path / "run"
  worker0, worker1 = _two_workers(
      [sys.executable, "-m", "tfdist.train",
       "--model=tests.lost_at_build:build", f"--model_dir={model_dir}",
       f"--data_dir={data_dir}", "--strategy=multi_worker_mirrored",
       "--train_steps=5"], timeout=240, grace=60)
  assert worker1.returncode == 3, worker1.stdout[-2000:]
  output = worker0.stdout
  assert worker0.returncode == PEER_LOST_EXIT_CODE, output[-3000:]
  assert re.search(r"tfdist: error: a collective on worker:0 outside a "
                   r"loop call lost a peer: a peer stopped answering\. "
                   r"Peers: worker:1 \(127\.0\.0\.1:\d+\)\.", output), \
      output[-3000:]
  assert "Traceback" not in output, output[-3000:]
  assert not glob.glob(str(model_dir / "ckpt-*"))
