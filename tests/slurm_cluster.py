"""A real one-node Slurm (munged, slurmctld, slurmd) for the tests.

Idempotent: it starts only what is not already running, and stops, by PID,
only what it started. Needs root and Debian's slurm-wlm and munge
(.ci/run installs them).
"""

import os
import shutil
import subprocess
import time

import portpicker

SLURM_CONF = """\
ClusterName=tfdist
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs=6 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def available():
  return os.geteuid() == 0 and all(
      shutil.which(tool) for tool in ("munged", "slurmctld", "slurmd",
                                      "sbatch"))


def _pgrep(name):
  return subprocess.run(["pgrep", "-x", name], capture_output=True).returncode \
      == 0


class SlurmCluster:
  """Context manager: a running single-node cluster; .env for clients."""

  def __init__(self, root):
    self.root = root
    self.conf = os.path.join(root, "slurm.conf")
    self.env = {**os.environ, "SLURM_CONF": self.conf}
    self._started = []  # (name, pid) of what we started.

  def __enter__(self):
    os.makedirs(os.path.join(self.root, "state"), exist_ok=True)
    os.makedirs(os.path.join(self.root, "spool"), exist_ok=True)
    with open(self.conf, "w") as f:
      f.write(SLURM_CONF.format(root=self.root,
                                ctld_port=portpicker.pick_unused_port(),
                                d_port=portpicker.pick_unused_port()))
    self._start_munged()
    self._start("slurmctld", ["slurmctld", "-c", "-f", self.conf],
                os.path.join(self.root, "slurmctld.pid"))
    self._start("slurmd", ["slurmd", "-f", self.conf, "-N", "localhost"],
                os.path.join(self.root, "slurmd.pid"))
    self._wait_for_idle_node()
    return self

  def __exit__(self, *exc):
    for name, pid in reversed(self._started):
      try:
        os.kill(pid, 15)
      except ProcessLookupError:
        continue
      for _ in range(50):
        try:
          os.kill(pid, 0)
          time.sleep(0.1)
        except ProcessLookupError:
          break

  def _start_munged(self):
    if _pgrep("munged"):
      return
    os.makedirs("/run/munge", exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
    with open("/run/munge/munged.pid") as f:
      self._started.append(("munged", int(f.read())))

  def _start(self, name, argv, pid_file):
    subprocess.run(argv, check=True, env=self.env)
    for _ in range(100):
      if os.path.exists(pid_file):
        with open(pid_file) as f:
          text = f.read().strip()
        if text:
          self._started.append((name, int(text)))
          return
      time.sleep(0.1)
    raise RuntimeError(f"{name} did not start; see {self.root}/*.log")

  def _wait_for_idle_node(self, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      state = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env,
                             capture_output=True, text=True).stdout.strip()
      if state.startswith("idle"):
        return
      time.sleep(0.5)
    raise RuntimeError(f"node not idle after {timeout}s (state {state!r})")

  def sbatch(self, args, *, cwd, timeout=600):
    """Submits, waits for the job, returns (exit code, its output)."""
    out = os.path.join(self.root, f"job-{time.monotonic_ns()}.out")
    proc = subprocess.run(["sbatch", "--wait", f"--output={out}", *args],
                          cwd=cwd, env=self.env, capture_output=True,
                          text=True, timeout=timeout)
    text = open(out).read() if os.path.exists(out) else ""
    return proc.returncode, proc.stdout + proc.stderr + text
