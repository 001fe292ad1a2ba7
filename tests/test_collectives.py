"""tfdist.collectives and the sharded optimizer update on real strategies:
the all-to-all reduce-scatter and the all-gather of shards give the
all-reduced sum, and the sharded update gives one device's weights and
slots, on mirrored(2), mirrored(4) and two MultiWorkerMirrored processes
(tests/strategy_checks.py checks the numbers; one fresh process per
strategy, since the logical CPUs are fixed at start-up, runs each of its
cases)."""

import json
import os
import subprocess
import sys
import tempfile
import time

import portpicker
import pytest

from conftest import ROOT
from tfdist.collectives import BUCKET_ELEMENTS as ONE_BUCKET

CHECK = os.path.join(ROOT, "tests", "strategy_checks.py")
# tests/strategy_checks.py's sharded cases: 8 steps of a cosine schedule
# with warmup; the weights and every slot against Keras's own update on
# one device.
# params: momentum as well as Adam, which a gradient off by a constant
# factor barely moves.
MIRRORED_CASES = {2: ["collectives", "sharded:adam:0.0",
                      "sharded:adam:0.0:40", "params:adam",
                      "params:momentum"],
                  4: ["collectives", "sharded:momentum:0.5",
                      "sharded:adamw:0.3:40", "params:momentum"]}
TWO_WORKER_CASES = ["collectives", "sharded:adam:0.5:40",
                    "sharded:momentum:0.5", "params:momentum"]


def _lines(proc, prefix):
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return [l for l in proc.stdout.splitlines() if l.startswith(prefix)]


def _two_workers(argv, timeout=600, grace=10):
  """Runs `argv` as two MultiWorkerMirrored processes (TF_CONFIG on
  127.0.0.1); returns their CompletedProcesses. When one fails, the other
  (left waiting in a collective) is killed `grace` seconds later, and
  both come back with what they printed. Their TMPDIR (a non-chief's
  scratch model_dir, which a killed worker leaves) is removed after, as
  a launcher's is."""
  with tempfile.TemporaryDirectory(prefix="tfdist-test-workers-") as scratch:
    return _two_workers_in(argv, timeout, grace, scratch)


def _two_workers_in(argv, timeout, grace, scratch):
  ports = [portpicker.pick_unused_port() for _ in range(2)]
  workers = [f"127.0.0.1:{p}" for p in ports]
  outputs = [tempfile.TemporaryFile(mode="w+") for _ in range(2)]
  procs = [subprocess.Popen(
      argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "TMPDIR": scratch, "TF_CONFIG": json.dumps({
          "cluster": {"worker": workers},
          "task": {"type": "worker", "index": i}})})
           for i, out in enumerate(outputs)]
  deadline = time.monotonic() + timeout
  while any(p.poll() is None for p in procs):
    if any(p.poll() not in (None, 0) for p in procs):
      deadline = min(deadline, time.monotonic() + grace)
    if time.monotonic() > deadline:
      for proc in procs:
        proc.kill()
    time.sleep(0.2)
  results = []
  for proc, out in zip(procs, outputs):
    out.seek(0)
    results.append(subprocess.CompletedProcess(proc.args, proc.wait(),
                                               out.read(), ""))
    out.close()
  return results


@pytest.fixture(scope="module")
def mirrored_runs():
  """replicas -> the CompletedProcess of its cases, run once."""
  runs = {}

  def run(replicas):
    if replicas not in runs:
      argv = [sys.executable, CHECK, "mirrored", str(replicas),
              *MIRRORED_CASES[replicas]]
      try:
        runs[replicas] = subprocess.run(argv, cwd=ROOT, capture_output=True,
                                        text=True, timeout=600)
      except subprocess.TimeoutExpired as e:  # Fails each test once.
        runs[replicas] = subprocess.CompletedProcess(
            argv, -9, "", f"timed out after {e.timeout} s")
    return runs[replicas]
  return run


@pytest.fixture(scope="module")
def two_worker_runs():
  return _two_workers([sys.executable, CHECK, "multi_worker",
                       *TWO_WORKER_CASES])


@pytest.mark.parametrize("replicas", [2, 4])
def test_reduce_scatter_and_all_gather_on_mirrored(replicas, mirrored_runs):
  lines = _lines(mirrored_runs(replicas), "collectives ok:")
  assert [l.split(", shard_size")[0] for l in lines] == [
      f"collectives ok: {replicas} replicas, {buckets} bucket(s)"
      for buckets in (1, 11)]


def test_reduce_scatter_and_all_gather_on_two_workers(two_worker_runs):
  ranks = set()
  for result in two_worker_runs:
    lines = _lines(result, "collectives ok:")
    assert [l.split(", shard_size")[0] for l in lines] == [
        "collectives ok: 2 replicas, 1 bucket(s)",
        "collectives ok: 2 replicas, 11 bucket(s)"], lines
    ranks.add(lines[0].split("ranks ")[1].split("]")[0])
  assert ranks == {"[0", "[1"}  # Each worker holds its own shard.


def _assert_sharded(proc, replicas, optimizer, clip, bucket=None):
  """`bucket`: elements per collective (None: one bucket)."""
  [line] = [l for l in _lines(proc, "sharded ok:")
            if f", {optimizer}, clip {clip}, bucket "
            f"{bucket or ONE_BUCKET}," in l]
  assert f"{replicas} replicas" in line
  held, whole = (int(n) for n in
                 line.split("state per replica ")[1].split(" bytes")[0]
                 .split(" of "))
  slots = 2 if optimizer.startswith("adam") else 1
  # 1/N of the state, up to the padding: under one element per rank and
  # bucket (the model's 207 weights: 1 bucket, or 6 of at most 40).
  buckets = 1 if bucket is None else -(-207 // int(bucket))
  assert 0 <= held * replicas - whole < buckets * replicas * 4 * slots, line


@pytest.mark.parametrize("replicas,optimizer,clip,bucket", [
    (2, "adam", "0", None), (2, "adam", "0", 40), (4, "momentum", "0.5", None),
    (4, "adamw", "0.3", 40)])
def test_sharded_update_gives_one_devices_weights_and_slots(
    replicas, optimizer, clip, bucket, mirrored_runs):
  _assert_sharded(mirrored_runs(replicas), replicas, optimizer, clip, bucket)


@pytest.mark.parametrize("optimizer,bucket", [("adam", 40), ("momentum", None)])
def test_sharded_update_on_two_workers(optimizer, bucket, two_worker_runs):
  for result in two_worker_runs:
    _assert_sharded(result, 2, optimizer, "0.5", bucket)


def _assert_params(proc, replicas, optimizer):
  [line] = [l for l in _lines(proc, "params ok:") if f", {optimizer}," in l]
  assert f"{replicas} replicas" in line
  held, whole = (int(n) for n in
                 line.split("state per replica ")[1].split(" bytes")[0]
                 .split(" of "))
  # 1/N of the weights and slots, up to the padding: under one element
  # per rank, unit and copy (2 units; weights and at most 2 slots).
  assert 0 <= held * replicas - whole < 2 * replicas * 4 * 3, line


@pytest.mark.parametrize("replicas,optimizer", [
    (2, "adam"), (2, "momentum"), (4, "momentum")])
def test_sharded_weights_give_one_devices_weights(replicas, optimizer,
                                                  mirrored_runs):
  _assert_params(mirrored_runs(replicas), replicas, optimizer)


def test_sharded_weights_on_two_workers(two_worker_runs):
  for result in two_worker_runs:
    _assert_params(result, 2, "momentum")
