"""Local cluster launcher: one process per task on 127.0.0.1.

python -m launch.local --workers=2 [--chief] [--ps=N] [--evaluator]
    [--max_restarts=K] [--backoff_seconds=S] -- <tfdist.train flags>

Every task gets its own TF_CONFIG (built by tfdist.cluster) and every output
line is prefixed with `role:index`. When a task fails, the launcher stops
the others and relaunches the whole job after an exponential backoff, up to
--max_restarts times; training resumes from the checkpoint. Ctrl-C or
SIGTERM is forwarded to every task, and no task outlives the launcher.

Exit code: 0 when training finished, otherwise the failing task's code
(or 1), and 128+N when the launcher itself got signal N.
"""

import argparse
import signal
import sys
import time

import portpicker

from launch import description
from launch import processes
from tfdist.errors import PREEMPTED_EXIT_CODE


def parse_args(argv):
  parser = argparse.ArgumentParser(
      prog="python -m launch.local",
      description="Run a tfdist job as local processes on 127.0.0.1.")
  description.add_arguments(parser)
  add_restart_arguments(parser)
  args = parser.parse_args(argv)
  finish_args(parser, args)
  try:
    args.cluster = description.from_args(args)
  except ValueError as e:
    parser.error(str(e))
  return args


def add_restart_arguments(parser):
  """Flags every process-starting launcher shares."""
  parser.add_argument("--max_restarts", type=int, default=0,
                      help="Relaunch the job this many times after a task "
                      "fails (default 0).")
  parser.add_argument("--backoff_seconds", type=float, default=1.0,
                      help="Wait before restart k: backoff * 2**(k-1).")
  parser.add_argument("--stop_grace_seconds", type=float, default=30.0,
                      help="After SIGTERM, wait this long before SIGKILL.")
  parser.add_argument("--module", default="tfdist.train",
                      help="Python module each task runs (default "
                      "tfdist.train).")
  parser.add_argument("train_args", nargs=argparse.REMAINDER,
                      help="-- then the flags of the training program.")


def finish_args(parser, args):
  if args.train_args and args.train_args[0] == "--":
    args.train_args = args.train_args[1:]
  if args.max_restarts < 0:
    parser.error(f"--max_restarts must be >= 0. Received: "
                 f"{args.max_restarts}")


def _local_addresses(cluster):
  """Fresh free ports on 127.0.0.1 for every task, every attempt."""
  return {role: [f"127.0.0.1:{portpicker.pick_unused_port()}"
                 for _ in range(count)]
          for role, count in cluster.counts().items()}


def local_tasks(args):
  """Fresh free ports on 127.0.0.1 for every task, every attempt."""
  return description.task_commands(
      args.cluster, addresses=_local_addresses(args.cluster),
      module=args.module, train_args=args.train_args)


class Launcher:
  """Runs the job, restarting it on failure; see the module docstring.

  `make_tasks(args)` gives the TaskSpecs of one attempt: local processes
  here, ssh commands in launch.ssh.
  """

  def __init__(self, args, *, make_tasks=local_tasks, out=sys.stdout):
    self._args = args
    self._make_tasks = make_tasks
    self._out = out
    self._signalled = None
    self._job = None

  def _log(self, message):
    processes.write_line(self._out, f"[launch] {message}")

  def _on_signal(self, signum, frame):
    del frame
    self._signalled = signum
    if self._job:
      self._job.forward(signum)

  def run(self):
    for signum in (signal.SIGINT, signal.SIGTERM):
      signal.signal(signum, self._on_signal)
    restarts = 0
    while True:
      code, failed = self._run_once(restarts)
      if self._signalled:
        self._log(f"stopped by signal {self._signalled}.")
        return 128 + self._signalled
      if code == 0:
        self._log("training finished: every task exited 0.")
        return 0
      if restarts >= self._args.max_restarts:
        self._log(f"{failed} exited with code {code}; no restarts left "
                  f"({restarts} of {self._args.max_restarts} used). "
                  "Training did not finish.")
        return code if code > 0 else 1
      restarts += 1
      delay = self._args.backoff_seconds * 2 ** (restarts - 1)
      why = ("was preempted and saved a checkpoint"
             if code == PREEMPTED_EXIT_CODE else f"exited with code {code}")
      self._log(f"{failed} {why}; restarting the job in "
                f"{delay:.1f}s (restart {restarts} of "
                f"{self._args.max_restarts}).")
      if self._sleep(delay):
        return 128 + self._signalled

  def _sleep(self, seconds):
    """Sleeps unless a signal arrives; returns True if one did."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not self._signalled:
      time.sleep(0.05)
    return bool(self._signalled)

  def _run_once(self, attempt):
    self._job = processes.Job(self._make_tasks(self._args), out=self._out,
                              grace_seconds=self._args.stop_grace_seconds,
                              log=self._log)
    self._job.start()
    for task in self._job.tasks:
      self._log(f"started {task.name} pid={task.process.pid} at "
                f"{task.address} (attempt {attempt + 1})")
    try:
      return self._wait_restarting_alone()
    finally:
      self._job.stop()
      self._job = None

  def _wait_restarting_alone(self):
    """Waits for the job; restarts a task on its own where that is enough.

    Returns (exit code, name of the failed task or None).
    """
    restarts = {}
    while True:
      code, task = self._job.wait()
      if code == 0:
        return 0, None
      role = task.spec.role
      used = restarts.get(task.name, 0)
      if (self._signalled or used >= self._args.max_restarts or
          not description.restarts_alone(self._args.cluster, role)):
        return code, task.name
      restarts[task.name] = used + 1
      delay = self._args.backoff_seconds * 2 ** used
      self._log(f"{task.name} exited with code {code}; restarting it alone "
                f"in {delay:.1f}s (restart {used + 1} of "
                f"{self._args.max_restarts}); the coordinator re-dispatches "
                "its steps.")
      if self._sleep(delay):
        return code, task.name
      self._job.start_task(task)
      self._log(f"started {task.name} pid={task.process.pid} at "
                f"{task.address}")


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  sys.exit(Launcher(args).run())


if __name__ == "__main__":
  main()
