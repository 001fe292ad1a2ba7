"""A group of task processes: start, prefix their output, stop them all."""

import ctypes
import os
import signal
import subprocess
import tempfile
import threading
import time

from tfdist.errors import PEER_LOST_EXIT_CODE

_WRITE_LOCK = threading.Lock()
_PR_SET_PDEATHSIG = 1
# Tasks that serve others; the job is done when the rest exit 0. (The
# evaluator is not one of them: it exits after the final checkpoint.) In a
# PS job the workers serve the chief too: once it is done they are not
# needed, and a worker restarted after the chief's exit would wait for it
# forever.
SERVING_ROLES = ("ps",)
PS_JOB_SERVING_ROLES = ("ps", "worker")


def write_line(out, text):
  with _WRITE_LOCK:
    out.write(text if text.endswith("\n") else text + "\n")
    out.flush()


def _load_libc():
  try:
    return ctypes.CDLL("libc.so.6", use_errno=True)
  except OSError:
    return None  # Not Linux: Job.stop() still ends every task.


# Resolved once, here in the parent: a dlopen in a forked child, with
# other threads alive, can deadlock on the loader's lock.
_LIBC = _load_libc()


def _die_with_parent():
  """In the child: get SIGKILL if the launcher dies, so none is orphaned."""
  if _LIBC is not None:
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start_local(argv, env):
  """A task's local process: its output piped, its own session, and
  SIGKILL when the launcher dies."""
  return subprocess.Popen(
      argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      stdin=subprocess.DEVNULL, start_new_session=True,
      preexec_fn=_die_with_parent)


def start_spare(argv, env):
  """A warm spare (launch.spare): as start_local, with its stdin piped
  for its order."""
  return subprocess.Popen(
      argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      stdin=subprocess.PIPE, start_new_session=True,
      preexec_fn=_die_with_parent)


class _Task:

  def __init__(self, spec):
    self.spec = spec
    self.name = spec.name
    self.address = spec.address
    self.process = None
    self.pump = None
    self.abandoned = False  # Failed for good; the job goes on without it.
    self.warm = False  # Its process is a warm spare (launch.spare).


class Job:
  """Starts every task; `wait()` returns (exit code, failed task)."""

  def __init__(self, specs, *, out, grace_seconds=30.0, poll_seconds=0.1,
               log=lambda message: None, scratch_root=None, spawn=None,
               spares=None):
    self.tasks = [_Task(spec) for spec in specs]
    self._scratch_root = scratch_root
    # spawn(spec, env) -> a Popen-like process; local processes by default,
    # Ray actors in launch.ray.
    self._spawn = spawn or self._spawn_local
    self._spares = spares  # A launch.spare.Spares for local processes.
    self._log = log
    self._out = out
    self._grace_seconds = grace_seconds
    self._poll_seconds = poll_seconds

  def start(self):
    for task in self.tasks:
      self.start_task(task)

  def start_task(self, task):
    """(Re)starts one task with its own command and environment."""
    task.warm = False
    task.process = self._spawn(task.spec,
                               {**task.spec.env, "PYTHONUNBUFFERED": "1"})
    task.warm = getattr(task.process, "warm", False)
    task.pump = threading.Thread(target=self._pump, args=(task,),
                                 daemon=True)
    task.pump.start()

  def _pump(self, task):
    for raw in task.process.stdout:
      write_line(self._out, f"{task.name} | "
                 + raw.decode("utf-8", "replace").rstrip("\n"))

  def _spawn_local(self, spec, env):
    env = {**os.environ, **env}
    if self._scratch_root:
      # The task's temporary files, under the launcher's scratch directory.
      env["TMPDIR"] = tempfile.mkdtemp(prefix=f"{spec.role}{spec.index}-",
                                       dir=self._scratch_root)
    process = self._spares.take(spec.argv, env) if self._spares else None
    if process is not None:
      process.warm = True
      return process
    return start_local(spec.argv, env)

  def abandon(self, task):
    """Stops watching a task that failed for good."""
    task.abandoned = True

  def signal_role(self, role, signum):
    for task in self.tasks:
      if task.spec.role == role and task.process.poll() is None:
        task.process.send_signal(signum)

  def wait_role(self, role, timeout):
    """Waits for the tasks of `role`; SIGKILL to any still running after
    `timeout` seconds."""
    self._wait_or_kill([t for t in self.tasks if t.spec.role == role],
                       timeout)

  def _wait_or_kill(self, tasks, timeout):
    """Waits for `tasks` together; SIGKILL to any still running after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    for task in tasks:
      try:
        task.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
      except subprocess.TimeoutExpired:
        self._log(f"{task.name} did not stop within {timeout:g}s; SIGKILL")
        task.process.kill()
        task.process.wait()

  def _serving_roles(self):
    if any(t.spec.role == "ps" for t in self.tasks):
      return PS_JOB_SERVING_ROLES
    return SERVING_ROLES

  def finished(self, role):
    """True when every task of `role` exited 0."""
    tasks = [t for t in self.tasks if t.spec.role == role]
    return bool(tasks) and all(t.process.poll() == 0 for t in tasks)

  def wait(self, on_poll=None):
    """Returns (0, None) when every non-serving task exited 0, else
    (exit code, task) for the first task that failed. A serving task that
    fails after that no longer matters. Abandoned tasks count for
    neither. `on_poll()` is called between polls."""
    serving = self._serving_roles()
    while True:
      if on_poll:
        on_poll()
      watched = [t for t in self.tasks if not t.abandoned]
      trainers = [t for t in watched if t.spec.role not in serving]
      if all(t.process.poll() == 0 for t in trainers):
        return 0, None
      failed = [t for t in watched if t.process.poll() not in (None, 0)]
      if failed:
        # Of the tasks seen failed in one poll, one killed by a signal is
        # the cause, then one with an error of its own; those that lost
        # a peer come last.
        task = min(failed, key=lambda t: (
            t.process.poll() >= 0, t.process.poll() == PEER_LOST_EXIT_CODE))
        return task.process.poll(), task
      time.sleep(self._poll_seconds)

  def cause(self, failed):
    """After stop(): the task whose loss ended the attempt. One that only
    lost a peer gives way to one whose process was lost (a Ray actor on a
    node that is gone), which the launcher may learn of only later."""
    if failed is None or failed.process.poll() != PEER_LOST_EXIT_CODE:
      return failed
    lost = [t for t in self.tasks if getattr(t.process, "lost", False)]
    return lost[0] if lost else failed

  def failed_alike(self, code, timeout):
    """True when every training task exits with `code` within `timeout`
    seconds: an error of the job (a bad flag, a bug), not a lost task."""
    # Every task that runs the training program with the job's flags
    # (PS workers too), but not the ps tasks or the evaluator (it waits
    # for checkpoints, and fails alone).
    left_out = ("ps", "evaluator")
    trainers = [t for t in self.tasks
                if not t.abandoned and t.spec.role not in left_out]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      codes = [t.process.poll() for t in trainers]
      if None not in codes:
        return len(trainers) > 1 and all(c == code for c in codes)
      if any(c not in (None, code) for c in codes):
        return False
      time.sleep(self._poll_seconds)
    return False

  def forward(self, signum):
    for task in self.tasks:
      if task.process and task.process.poll() is None:
        task.process.send_signal(signum)

  def stop(self):
    """SIGTERM to what still runs, SIGKILL after the grace period."""
    running = [t for t in self.tasks if t.process and t.process.poll() is None]
    if running:
      self._log(f"stopping {', '.join(t.name for t in running)} (SIGTERM, "
                f"then SIGKILL after {self._grace_seconds:g}s)")
    self.forward(signal.SIGTERM)
    self._wait_or_kill(running, self._grace_seconds)
    for task in self.tasks:
      if task.pump:
        task.pump.join(timeout=5)
