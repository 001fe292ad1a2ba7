"""The launcher core every process-starting launcher shares: the restart
policy and signal forwarding (their flags: launch.arguments).

A launcher gives `Launcher` a function that makes the TaskSpecs of one
attempt (local processes, ssh commands, Ray actors); the policy is the
same for all of them:
- a task fails: the other tasks get SIGTERM (SIGKILL after
  --stop_grace_seconds) and the whole job is relaunched after
  --backoff_seconds * 2**(k-1), up to --max_restarts times;
- in a PS job a failed worker is never fatal: it is restarted on its own
  while it has restarts left, and then the job carries on without it. Only
  when every worker is gone is the chief asked to checkpoint and stop;
- a task that finds its port taken (another program bound it between the
  launcher's probe and the task's bind) exits 43, and the job is
  relaunched with new ports without using up a restart;
- every task's temporary files live in a directory of the launcher's,
  removed at the end;
- Ctrl-C or SIGTERM to the launcher is forwarded to every task;
- an elastic job (--workers=MIN:MAX) changes its membership by restarting
  the whole group from the checkpoint with a new TF_CONFIG: a worker that
  fails with no restarts left is dropped while at least MIN remain, and
  when `discover` offers more slots (up to MAX) or fewer, every task is
  asked to save (SIGTERM: tfdist's preemption save) and the group
  restarts at the new size. Each change restores the restart budget.

Exit code: 0 when training finished, otherwise the failing task's code
(or 1), and 128+N when the launcher itself got signal N.
"""

import argparse
import os
import signal
import sys
import tempfile
import threading
import time

from . import description
from . import processes
from .membership import Membership
from .membership import SlotsUnavailable
from tfdist.errors import PEER_LOST_EXIT_CODE
from tfdist.errors import PORT_TAKEN_EXIT_CODE
from tfdist.errors import PREEMPTED_EXIT_CODE

# A failure that every training task reports alike within this many
# seconds is the job's error (a bad flag, a bug): it ends the job rather
# than restarting it or dropping a worker.
JOB_ERROR_WINDOW = 3.0
# (255: ssh's own failure, such as a lost connection, on every task.)
_NOT_THE_JOBS_ERROR = (PREEMPTED_EXIT_CODE, PORT_TAKEN_EXIT_CODE,
                       PEER_LOST_EXIT_CODE, 255)
# Relaunches, beyond --max_restarts, after a probed port was taken.
MAX_PORT_RETRIES = 5


class Launcher:
  """Runs the job, restarting it on failure; see the module docstring.

  `make_tasks(args)` gives the TaskSpecs of one attempt: local processes
  in launch.local, ssh commands in launch.ssh; `args.cluster` is the
  attempt's membership. `discover()` (elastic jobs) returns the worker
  slots available now, or None when it cannot tell. `drop_worker(spec)`
  tells the launcher that the worker of TaskSpec `spec`, of the attempt
  that just ended, is dropped for good (launch.ssh then gives up a slot of
  its host, launch.ray its node): by host, not by index, since a
  discovery may have reordered the slots since.
  """

  def __init__(self, args, *, make_tasks, out=sys.stdout, spawn=None,
               discover=None, discover_every_seconds=5.0,
               drop_worker=None, spares=None):
    self._args = args
    # A launch.spare.Spares: warm processes for the tasks of a restart.
    self._spares = spares
    self._make_tasks = make_tasks
    self._spawn = spawn
    self._out = out
    self._signalled = None
    self._job = None
    self._scratch = None
    self._members = Membership(
        args.cluster, discover=discover, drop_worker=drop_worker,
        every_seconds=discover_every_seconds,
        backoff_seconds=args.backoff_seconds, log=self._log,
        sleep=self._sleep)
    self._resize_to = None  # A size change asked of the running group.
    self._failed_at = None
    self._failed_task = None  # The task whose failure ended an attempt.
    self._job_error = False

  def _log(self, message):
    processes.write_line(self._out, f"[launch] {message}")

  def _on_signal(self, signum, frame):
    del frame
    self._signalled = signum
    if self._job:
      # From a thread: forwarding may be a remote call (Ray), which must
      # not run re-entrantly inside the main thread's own remote call.
      threading.Thread(target=self._job.forward, args=(signum,),
                       daemon=True).start()

  def run(self):
    """Runs the job to the end; returns the launcher's exit code."""
    # Every task's temporary files (a worker's scratch model_dir) go under
    # one directory of the launcher's, removed at the end even after a
    # SIGKILLed task: nothing is left behind.
    with tempfile.TemporaryDirectory(prefix="tfdist-launch-") as scratch:
      self._scratch = scratch
      try:
        return self._run()
      finally:
        if self._spares:
          self._spares.close()

  def _run(self):
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup
        signal.signal(signum, self._on_signal)
    restarts = port_retries = attempts = 0
    if self._members.discovers and not self._members.wait_for_min_slots():
      return 128 + self._signalled if self._signalled else 1
    while True:
      try:
        code, failed = self._run_once(attempts)
      except SlotsUnavailable as e:
        if self._signalled or not self._place_smaller(e):
          raise
        continue
      attempts += 1
      if self._signalled:
        self._log(f"stopped by signal {self._signalled}.")
        return 128 + self._signalled
      if code == 0:
        self._log("training finished: every training task exited 0.")
        return 0
      if self._job_error:
        self._log(f"every training task exited with code {code}: an error "
                  "of the job (see the first error line above), not a lost "
                  "task; not restarting. Training did not finish.")
        return code
      if self._resize_to is not None:
        if not self._change_membership(self._resize_to, "discovery offers "
                                       "that many slots; the group was "
                                       "asked to save its step first"):
          return 128 + self._signalled if self._signalled else 1
        restarts = 0
        continue
      if code == PORT_TAKEN_EXIT_CODE and port_retries < MAX_PORT_RETRIES:
        # Another program took a probed port before the task bound it: a
        # race, not a failure, so it uses up no restart.
        port_retries += 1
        self._log(f"{failed} found its port taken; relaunching with new "
                  f"ports ({port_retries} of {MAX_PORT_RETRIES}).")
        continue
      if code == PREEMPTED_EXIT_CODE:
        # A preemption is not a failure: the task saved its step, and
        # Kubernetes would restart a preempted pod. It uses no restart.
        self._log(f"{failed} was preempted and saved a checkpoint; "
                  "resuming the job (a preemption uses no restart).")
        continue
      cluster = self._members.cluster
      if restarts >= self._args.max_restarts and cluster.elastic and (
          failed.startswith("worker:")):
        if not self._members.can_shrink():
          self._log(f"{failed} exited with code {code} with no restarts "
                    f"left, and {cluster.workers - 1} worker(s) would "
                    f"be below the minimum of {cluster.min_workers} "
                    "(--workers=MIN:MAX). Training did not finish.")
          return code if code > 0 else 1
        self._members.drop(self._failed_task)
        if not self._change_membership(
            cluster.workers - 1,
            f"{failed} exited with code {code} with no restarts left"):
          return 128 + self._signalled if self._signalled else (
              code if code > 0 else 1)
        restarts = 0
        continue
      if restarts >= self._args.max_restarts:
        self._log(f"{failed} exited with code {code}; no restarts left "
                  f"({restarts} of {self._args.max_restarts} used). "
                  "Training did not finish.")
        return code if code > 0 else 1
      restarts += 1
      delay = self._args.backoff_seconds * 2 ** (restarts - 1)
      self._log(f"{failed} exited with code {code}; restarting the job in "
                f"{delay:.1f}s (restart {restarts} of "
                f"{self._args.max_restarts}).")
      if self._sleep(delay):
        return 128 + self._signalled

  def _place_smaller(self, error):
    """An elastic group that cannot be placed at its size (Ray may list
    a node that is gone as alive) runs one smaller while MIN allows."""
    self._failed_at = None
    return self._members.shrink_unplaceable(str(error))

  def _change_membership(self, workers, why):
    stopped_in = time.monotonic() - self._failed_at if self._failed_at else 0.0
    return self._members.change(workers, why, stopped_in=stopped_in)


  def _poll_discovery(self):
    """Called while the group runs: asks the group to save and restart
    when the slots on offer give another size within MIN:MAX."""
    if self._resize_to is not None:
      return
    wanted = self._members.offered_size()
    if wanted is not None:
      self._resize_to = wanted
      self._job.forward(signal.SIGTERM)

  def _sleep(self, seconds):
    """Sleeps unless a signal arrives; returns True if one did."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not self._signalled:
      time.sleep(0.05)
    return bool(self._signalled)

  def _run_once(self, attempt):
    self._resize_to = None
    args = argparse.Namespace(**{**vars(self._args),
                                 "cluster": self._members.cluster})
    self._job = processes.Job(self._make_tasks(args), out=self._out,
                              grace_seconds=self._args.stop_grace_seconds,
                              log=self._log, scratch_root=self._scratch,
                              spawn=self._spawn, spares=self._spares)
    self._job.start()
    for task in self._job.tasks:
      self._log(f"started {task.name} pid={task.process.pid} at "
                f"{task.address} (attempt {attempt + 1}"
                f"{', a warm spare' if task.warm else ''})")
    if self._spares:
      if attempt == 0:  # After the tasks: their imports go first.
        self._spares.start({**os.environ, "PYTHONUNBUFFERED": "1"})
      self._log("warm spares waiting for a restart's tasks: pids "
                f"{', '.join(map(str, self._spares.pids))}")
    if self._signalled:  # It came while the tasks were made (Ray places).
      self._job.forward(self._signalled)
    try:
      code, failed = self._wait_restarting_alone()
      self._failed_at = time.monotonic()
      self._job_error = (code not in _NOT_THE_JOBS_ERROR and code > 0
                         and self._resize_to is None
                         and self._job.failed_alike(code, JOB_ERROR_WINDOW))
    finally:
      self._job.stop()
      cause = self._job.cause(self._failed_task)
      self._job = None
    if cause is not self._failed_task:
      self._log(f"{cause.name} was lost (its process is gone with its "
                f"host); {failed} only lost a peer.")
      self._failed_task = cause
      return cause.process.poll(), cause.name
    return code, failed

  def _wait_restarting_alone(self):
    """Waits for the job; restarts a task on its own where that is enough.

    A PS worker is never fatal: with restarts left it is restarted alone;
    without, the job carries on without it. When every worker is gone,
    the chief is asked (SIGTERM) to checkpoint and stop.

    Returns (exit code, name of the failed task or None).
    """
    restarts = {}
    while True:
      code, task = self._job.wait(on_poll=self._poll_discovery)
      self._failed_task = task
      if code == 0:
        return 0, None
      if self._resize_to is not None:  # The group saved to be resized.
        return code, task.name
      role = task.spec.role
      used = restarts.get(task.name, 0)
      alone = description.restarts_alone(self._args.cluster, role)
      if self._signalled or not alone or code == PORT_TAKEN_EXIT_CODE:
        return code, task.name
      if self._job.finished("chief"):
        # Training is over (the evaluator may still be at its last eval):
        # a restarted worker would wait for the chief forever.
        self._job.abandon(task)
        self._log(f"{task.name} exited with code {code} after the chief "
                  "finished; it is not needed any more.")
        continue
      if used >= self._args.max_restarts:
        self._job.abandon(task)
        left = [t.name for t in self._job.tasks if t.spec.role == role and
                not t.abandoned]
        minimum = self._members.cluster.min_workers
        if left and len(left) < (minimum or 1):
          self._log(f"{task.name} exited with code {code} and has no "
                    f"restarts left; {len(left)} worker(s) left is below the "
                    f"minimum of {minimum} "
                    "(--workers=MIN:MAX): asking the chief to checkpoint "
                    "and stop.")
          left = []
        elif left:
          self._log(f"{task.name} exited with code {code} and has no "
                    f"restarts left; the job carries on without it "
                    f"({', '.join(left)} left).")
          continue
        self._log(f"{task.name} exited with code {code}: every worker is "
                  "gone; asking the chief to checkpoint and stop.")
        # Twice: the chief's PS guard saves at once on the second SIGTERM,
        # since no worker is left to finish the scheduled steps.
        self._job.signal_role("chief", signal.SIGTERM)
        time.sleep(1.0)
        self._job.signal_role("chief", signal.SIGTERM)
        self._job.wait_role("chief", self._args.stop_grace_seconds)
        return code, "every worker"
      restarts[task.name] = used + 1
      delay = self._args.backoff_seconds * 2 ** used
      self._log(f"{task.name} exited with code {code}; restarting it alone "
                f"in {delay:.1f}s (restart {used + 1} of "
                f"{self._args.max_restarts}); the coordinator re-dispatches "
                "its steps.")
      if self._sleep(delay):
        return code, task.name
      if self._job.finished("chief"):
        self._job.abandon(task)
        self._log(f"the chief finished meanwhile; {task.name} is not "
                  "restarted.")
        continue
      self._job.start_task(task)
      self._log(f"started {task.name} pid={task.process.pid} at "
                f"{task.address}{' (a warm spare)' if task.warm else ''}")
