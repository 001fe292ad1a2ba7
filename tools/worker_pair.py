"""The worker processes of one MultiWorkerMirrored job on loopback, for
the labs: each runs `python -m MODULE --worker=SPEC`, and sets its own
TF_CONFIG from the spec (ports from portpicker)."""

import subprocess
import sys
import tempfile

import portpicker


def ports(count=2):
  """`count` free loopback ports, joined by ':' for a worker spec."""
  return ":".join(str(portpicker.pick_unused_port()) for _ in range(count))


def run(module, specs, timeout=900):
  """Runs one `python -m module --worker=spec` per spec, together; returns
  their stdouts. Each worker's stderr goes to a file (a full pipe would
  block it inside a collective); when one fails its stderr's tail is
  raised, and workers still running are killed."""
  procs, logs = [], []
  try:
    for spec in specs:
      logs.append(tempfile.TemporaryFile())
      procs.append(subprocess.Popen(
          [sys.executable, "-m", module, f"--worker={spec}"],
          stdout=subprocess.PIPE, stderr=logs[-1], text=True))
    outs = []
    for proc, log in zip(procs, logs):
      out, _ = proc.communicate(timeout=timeout)
      if proc.returncode:
        log.seek(0)
        raise RuntimeError(f"a worker exited {proc.returncode}:\n"
                           f"{log.read()[-2000:].decode(errors='replace')}")
      outs.append(out)
    return outs
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    for log in logs:
      log.close()
