"""Warm spares: task processes that have imported TensorFlow and tfdist
before they are needed.

`python -m launch.spare` imports what every task imports (TensorFlow,
Keras, tfdist; no TF op runs, so no TF context exists), then waits on
stdin for one order: a JSON line {"module", "args", "env"}. It takes
that environment (TF_CONFIG among it) and runs the module as
`python -m module args...` would. End of stdin before an order: it exits
0, unused.

A launcher keeps a `Spares` pool beside a job that can restart. A
restart, a preemption resume or a membership change hands each task to a
spare, which saves the import (about 3.5 s per process here, most of a
task's start) and is replaced in the background. Spares are spawned
(never forked from a process that started TF), and die with the
launcher.

On another host (launch.ssh) a spare runs over `ssh -T`: its order adds
to that host's environment rather than replacing it with the launcher's,
and, as a task, it takes the end of its stdin (the ssh session closed)
for the hangup a tty would have given it: SIGHUP to its process group.
A spare handed its order while still importing goes on at nice 0.
"""

import collections
import os
import queue
import runpy
import signal
import sys
import tempfile
import threading

from absl import flags

from . import spare_order

# What a task imports before its first TF op, in that order (not the
# task's module itself: runpy runs that as __main__).
_WARM_MODULES = ("tensorflow", "keras", "tensorflow_datasets", "tfdist.api",
                 "tfdist.builder")
def _import_warm_modules():
  from absl import logging  # pylint: disable=g-import-not-at-top
  from tfdist import quiet  # pylint: disable=g-import-not-at-top
  # As in a task, where absl's app.run comes first: with the root logger
  # absl's, TF's logger adds no stderr handler of its own (which would
  # bypass tfdist.train's filter of other libraries' INFO lines).
  logging.use_absl_handler()
  # As tfdist.train does before TF starts: TF's C++ logging reads it once.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  with quiet.native_stderr_captured():
    for name in _WARM_MODULES:
      __import__(name)


# A waiting spare's nice value, so that its import yields to the job's own
# tasks. Only where it can be undone at hand-off: root.
SPARE_NICENESS = 19


def _be_nice_while_waiting():
  if os.geteuid() == 0:
    os.setpriority(os.PRIO_PROCESS, 0, SPARE_NICENESS)


def _undo_niceness():
  """Back to nice 0, every thread (Linux's nice is per thread): the task
  must not yield to others. Only root was made nicer."""
  if os.getpriority(os.PRIO_PROCESS, 0) <= 0:
    return
  for tid in os.listdir("/proc/self/task"):
    try:
      os.setpriority(os.PRIO_PROCESS, int(tid), 0)
    except (PermissionError, ProcessLookupError):
      pass


def _read_order(orders):
  """In a thread: the order line from stdin, put on `orders`. A task
  handed to a spare still importing is no longer nice: it is the job's
  now. End of stdin before an order: the launcher ended or no longer
  needs this spare, and it exits at once. A remote task's stdin then is
  its session: at its end, SIGHUP to the task's process group (sshd made
  it a session of its own), as the tty of a task started over `ssh -tt`
  would send. os.read, not sys.stdin: a thread blocked in a buffered read
  holds its lock, and the interpreter's exit would abort on it."""
  data = b""
  while b"\n" not in data:
    chunk = os.read(0, 4096)
    if not chunk:
      os._exit(0)  # pylint: disable=protected-access
    data += chunk
  order = spare_order.read_order(data.split(b"\n", 1)[0])
  _undo_niceness()
  orders.put(order)
  if order.get("remote"):
    while os.read(0, 4096):
      pass
    os.killpg(0, signal.SIGHUP)


def _take_order(order):
  """Becomes the task: its environment, then its module as __main__."""
  if not order.get("remote"):
    os.environ.clear()
  os.environ.update(order["env"])
  tempfile.tempdir = None  # TMPDIR is the task's now.
  sys.argv = [order["module"], *order["args"]]
  runpy.run_module(order["module"], run_name="__main__", alter_sys=True)


def main():
  _be_nice_while_waiting()
  orders = queue.Queue()
  threading.Thread(target=_read_order, args=(orders,), name="spare-order",
                   daemon=True).start()
  _import_warm_modules()
  _take_order(orders.get())


def _split_module_command(argv):
  """(prefix, module, args) of `... python -m module args`, else None."""
  if "-m" not in argv[:-1]:
    return None
  at = argv.index("-m")
  return argv[:at], argv[at + 1], argv[at + 2:]


def wants_native_logs(args):
  """TF reads its log level once, at the import a spare has done quietly:
  a task that asks for TF's native logs starts cold to get them. absl
  parses the two flags, in every form the task itself accepts."""
  wanted = flags.FlagValues()
  flags.DEFINE_bool("native_logs", False, "", flag_values=wanted)
  flags.DEFINE_integer("verbosity", 0, "", short_name="v",
                       flag_values=wanted)
  try:
    wanted(["task", *args], known_only=True)
  except flags.Error:
    return False  # The task itself reports its bad flag.
  return wanted.native_logs or wanted.verbosity >= 1


# As the launcher itself was imported: launch.spare in a checkout,
# tfdist.launch.spare where tfdist is installed.
MODULE = __spec__.name if __spec__ else "launch.spare"
# On another host, the installed name, as a cold task's tfdist.train.
REMOTE_MODULE = "tfdist.launch.spare"


def add_argument(parser):
  """--spares, for a launcher that keeps warm spares."""
  parser.add_argument(
      "--spares", default="auto",
      help="Warm spare processes (TensorFlow and tfdist imported, waiting) "
      "that a restart, a preemption resume or a membership change hands "
      "its tasks to, saving each task's import. A number per task, on the "
      "task's host, or auto: one per task when the job can restart "
      "(--max_restarts > 0 or --workers=MIN:MAX), else none (default).")


def count_from(parser, args):
  """--spares as a number per task (0: none). A task that asks for TF's
  native logs starts cold, so such a job keeps none."""
  if not args.spares.isdigit() and args.spares != "auto":
    parser.error(f"--spares must be auto or a number >= 0. Received: "
                 f"{args.spares}")
  if wants_native_logs(args.train_args):
    return 0
  if args.spares == "auto":
    return int(args.max_restarts > 0 or args.cluster.elastic)
  return int(args.spares)


class Spares:
  """Keeps `count` spares, each `start_process(command, env)` (a Popen-like
  process with stdin piped; `command` runs `python -m launch.spare`, behind
  `ip netns exec` or ssh where the tasks run there). `start(env)` makes
  them; `hand(module=, args=, env=)` gives a task to one. `remote`: the
  spares run on another host (module docstring)."""

  def __init__(self, *, command, count, start_process, remote=False,
               log=lambda message: None):
    if count < 0:
      raise ValueError(f"Spares: count must be >= 0. Received: {count}")
    self._command = list(command)
    self._count = count
    self._start_process = start_process
    self._remote = remote
    self._log = log
    self._env = None
    self._waiting = []

  def start(self, env):
    """Starts the spares, with the environment the tasks share."""
    self._env = dict(env)
    self._fill()

  def _fill(self):
    while self._env is not None and len(self._waiting) < self._count:
      self._waiting.append(self._start_one())

  def grow_to(self, count):
    """Keeps at least `count` spares from now on (a host that runs more
    tasks than before); the new ones start at once if started."""
    self._count = max(self._count, count)
    self._fill()

  def _start_one(self):
    return self._start_process(self._command, self._env)

  @property
  def pids(self):
    return [process.pid for process in self._waiting]

  def take(self, argv, env):
    """A local task's command `argv` (`python -m module args`, with the
    spares' own python and prefix) handed to a spare; None when `argv`
    runs something else."""
    split = _split_module_command(argv)
    if split is None or [*split[0], "-m", MODULE] != self._command:
      return None
    return self.hand(module=split[1], args=split[2], env=env)

  def hand(self, *, module, args, env):
    """A waiting spare, now running `module` with `args` and `env` (a
    local task's whole environment; a remote task's own variables); a new
    spare starts in its place. None when no spare waits, or the task asks
    for TF's native logs."""
    if wants_native_logs(args):
      return None
    order = spare_order.order_line(module=module, args=args, env=env,
                                   remote=self._remote)
    try:
      while self._waiting:
        process = self._waiting.pop(0)
        if process.poll() is not None:
          # The OOM killer, a lost host, a python without tfdist.
          self._log(f"warm spare pid={process.pid} had exited (code "
                    f"{process.poll()}) before it was needed: "
                    f"{spare_order.last_words(process) or 'no output'}")
          continue
        try:
          process.stdin.write(order)
          process.stdin.flush()
          if not self._remote:  # A remote task's stdin is its session.
            process.stdin.close()
        except OSError:
          continue
        return process
      return None
    finally:
      self._fill()  # New spares in the places taken.

  def close(self):
    """Ends the waiting spares (EOF on stdin, then SIGKILL)."""
    for process in self._waiting:
      try:
        process.stdin.close()
      except OSError:
        pass
    for process in self._waiting:
      # It holds no state, and may still be importing: no need to wait.
      process.kill()
      process.wait()
    self._waiting = []


class HostPools:
  """A pool of spares on every host (or Ray node) the tasks run on:
  `per_task` spares for each task the host has run at once, started with
  `start(env)` after the first attempt's tasks, or at once on a host first
  seen later. A host no task runs on now (dropped, or not offered) keeps
  none. `make_pool(host)` gives a host's empty pool: a Spares, or any
  object with its grow_to, start, pids and close. `pids_of(pools)`: the
  pids of all of them at once, where each pool would wait on its own."""

  def __init__(self, *, make_pool, per_task, pids_of=None):
    self._make_pool = make_pool
    self._per_task = per_task
    self._pids_of = pids_of or (
        lambda pools: [pid for pool in pools for pid in pool.pids])
    self._pools = {}
    self._env = None

  def pool(self, host):
    if host not in self._pools:
      self._pools[host] = self._make_pool(host)
      if self._env is not None:
        self._pools[host].start(self._env)
    return self._pools[host]

  def plan(self, task_hosts):
    """The hosts of an attempt's tasks, one entry per task."""
    tasks = collections.Counter(task_hosts)
    for host in [h for h in self._pools if h not in tasks]:
      self._pools.pop(host).close()
    for host, count in tasks.items():
      self.pool(host).grow_to(self._per_task * count)

  def start(self, env):
    self._env = dict(env)
    for pool in self._pools.values():
      pool.start(self._env)

  @property
  def pids(self):
    return self._pids_of(list(self._pools.values()))

  def close(self):
    for pool in self._pools.values():
      pool.close()
    self._pools = {}


if __name__ == "__main__":
  main()
