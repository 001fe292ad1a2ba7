"""The worker processes of one MultiWorkerMirrored job on loopback, for
the labs and benchmarks: each runs `python -m MODULE [ARGS] --worker=SPEC`
(behind a `prefix` such as `ip netns exec NS`), and sets its own
TF_CONFIG from the spec (ports from portpicker)."""

import json
import os
import subprocess
import sys
import tempfile
import time

import portpicker


def ports(count=2):
  """`count` free loopback ports, joined by ':' for a worker spec."""
  return ":".join(str(portpicker.pick_unused_port()) for _ in range(count))


def set_tf_config(index, joined_ports):
  """This worker's TF_CONFIG: worker `index` of the loopback workers on
  `joined_ports` (as ports() gives them). Before TF starts."""
  os.environ["TF_CONFIG"] = json.dumps({
      "cluster": {"worker": [f"127.0.0.1:{p}"
                             for p in joined_ports.split(":")]},
      "task": {"type": "worker", "index": int(index)}})


def run(module, specs, *, args=(), prefix=(), timeout=900, grace=10):
  """Runs one worker per spec, together; returns their stdouts. Each
  worker's stderr goes to a file (a full pipe would block it inside a
  collective). When one fails, the others (left waiting in a collective)
  are killed `grace` seconds later and its stderr's tail is raised;
  past `timeout` all are killed."""
  procs, logs = [], []
  try:
    for spec in specs:
      logs.append(tempfile.TemporaryFile())
      procs.append(subprocess.Popen(
          [*prefix, sys.executable, "-m", module, *args, f"--worker={spec}"],
          stdout=subprocess.PIPE, stderr=logs[-1], text=True))
    _wait(procs, logs, timeout, grace)
    return [proc.stdout.read() for proc in procs]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      proc.stdout.close()
    for log in logs:
      log.close()


def _wait(procs, logs, timeout, grace):
  """Waits for every worker; raises with the first failure's stderr.
  (Workers print a line or two: their stdout pipes cannot fill.)"""
  deadline = time.monotonic() + timeout
  while any(proc.poll() is None for proc in procs):
    failed = [p for p in procs if p.poll() not in (None, 0)]
    if failed:
      deadline = min(deadline, time.monotonic() + grace)
    if time.monotonic() > deadline:
      break
    time.sleep(0.1)
  for proc, log in zip(procs, logs):
    if proc.poll() not in (None, 0):
      log.seek(0)
      raise RuntimeError(f"a worker exited {proc.returncode}:\n"
                         f"{log.read()[-2000:].decode(errors='replace')}")
  if any(proc.poll() is None for proc in procs):
    raise RuntimeError(f"the workers ran past {timeout} s")
