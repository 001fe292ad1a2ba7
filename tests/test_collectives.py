"""tfdist.collectives on real strategies: the all-to-all reduce-scatter
and the all-gather of shards give the all-reduced sum, on mirrored(2),
mirrored(4) and two MultiWorkerMirrored processes (tests/collectives_check.py
checks the numbers; each run is a fresh process, since the logical CPUs
are fixed at start-up)."""

import json
import os
import subprocess
import sys

import portpicker
import pytest

from conftest import ROOT

CHECK = os.path.join(ROOT, "tests", "collectives_check.py")


def _passed(proc):
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return [l for l in proc.stdout.splitlines()
          if l.startswith("collectives ok:")]


@pytest.mark.parametrize("replicas", [2, 4])
def test_reduce_scatter_and_all_gather_on_mirrored(replicas):
  proc = subprocess.run([sys.executable, CHECK, "mirrored", str(replicas)],
                        cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  lines = _passed(proc)
  assert lines and f"{replicas} replicas" in lines[0]


def _two_workers(argv):
  """Runs `argv` as two MultiWorkerMirrored processes (TF_CONFIG on
  127.0.0.1); returns their CompletedProcesses."""
  ports = [portpicker.pick_unused_port() for _ in range(2)]
  workers = [f"127.0.0.1:{p}" for p in ports]
  procs = [subprocess.Popen(
      argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env={**os.environ, "TF_CONFIG": json.dumps({
          "cluster": {"worker": workers},
          "task": {"type": "worker", "index": i}})}) for i in range(2)]
  results = []
  for proc in procs:
    out, err = proc.communicate(timeout=300)
    results.append(subprocess.CompletedProcess(proc.args, proc.returncode,
                                               out, err))
  return results


def test_reduce_scatter_and_all_gather_on_two_workers():
  ranks = set()
  for result in _two_workers([sys.executable, CHECK, "multi_worker"]):
    lines = _passed(result)
    assert lines and "2 replicas" in lines[0]
    ranks.add(lines[0].split("ranks ")[1].split("]")[0])
  assert ranks == {"[0", "[1"}  # Each worker holds its own shard.


SHARDED = os.path.join(ROOT, "tests", "sharded_check.py")


def _assert_sharded(proc, replicas, optimizer):
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  [line] = [l for l in proc.stdout.splitlines()
            if l.startswith("sharded ok:")]
  assert f"{replicas} replicas" in line
  held, whole = (int(n) for n in
                 line.split("state per replica ")[1].split(" bytes")[0]
                 .split(" of "))
  slots = 2 if optimizer.startswith("adam") else 1
  # 1/N of the state, up to the padding of the flat buffer (< N elements).
  assert 0 <= held * replicas - whole < replicas * 4 * slots, line


# tests/sharded_check.py: 8 steps of a cosine schedule with warmup; the
# weights and every slot against Keras's own update on one device.
@pytest.mark.parametrize("replicas,optimizer,clip", [
    (2, "adam", 0.0), (4, "momentum", 0.5), (4, "adamw", 0.3)])
def test_sharded_update_gives_one_devices_weights_and_slots(
    replicas, optimizer, clip):
  _assert_sharded(subprocess.run(
      [sys.executable, SHARDED, str(replicas), optimizer, str(clip)],
      cwd=ROOT, capture_output=True, text=True, timeout=300),
                  replicas, optimizer)


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_sharded_update_on_two_workers(optimizer):
  for result in _two_workers([sys.executable, SHARDED, "0", optimizer,
                              "0.5"]):
    _assert_sharded(result, 2, optimizer)
