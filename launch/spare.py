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
"""

import json
import os
import runpy
import sys
import tempfile

from absl import flags

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


def _undo_niceness():
  """Back to nice 0, every thread (Linux's nice is per thread): the task
  must not yield to others. Only root was made nicer (processes.py)."""
  if os.getpriority(os.PRIO_PROCESS, 0) <= 0:
    return
  for tid in os.listdir("/proc/self/task"):
    try:
      os.setpriority(os.PRIO_PROCESS, int(tid), 0)
    except (PermissionError, ProcessLookupError):
      pass


def _take_order(order):
  """Becomes the task: its environment, then its module as __main__."""
  os.environ.clear()
  os.environ.update(order["env"])
  tempfile.tempdir = None  # TMPDIR is the task's now.
  _undo_niceness()
  sys.argv = [order["module"], *order["args"]]
  runpy.run_module(order["module"], run_name="__main__", alter_sys=True)


def main():
  _import_warm_modules()
  line = sys.stdin.readline()
  if not line:
    return  # The launcher ended, or no longer needs this spare.
  _take_order(json.loads(line))


def _split_module_command(argv):
  """(prefix, module, args) of `... python -m module args`, else None."""
  if "-m" not in argv[:-1]:
    return None
  at = argv.index("-m")
  return argv[:at], argv[at + 1], argv[at + 2:]


def _wants_native_logs(args):
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


class Spares:
  """Keeps `count` spares of the command `prefix + ['-m', 'launch.spare']`
  (prefix: the interpreter, behind `ip netns exec` where the tasks run
  in a namespace). `start(env)` makes them; `take(argv, env)` hands a
  task's command to one, or returns None when none fits."""

  def __init__(self, *, prefix, count, start_process):
    if count < 0:
      raise ValueError(f"Spares: count must be >= 0. Received: {count}")
    self._prefix = list(prefix)
    self._count = count
    # start_process(argv, env) -> a Popen with stdin and stdout piped.
    self._start_process = start_process
    self._env = None
    self._waiting = []

  def start(self, env):
    """Starts the spares, with the environment the tasks share."""
    self._env = dict(env)
    while len(self._waiting) < self._count:
      self._waiting.append(self._start_one())

  def _start_one(self):
    return self._start_process([*self._prefix, "-m", "launch.spare"],
                               self._env)

  @property
  def pids(self):
    return [process.pid for process in self._waiting]

  def take(self, argv, env):
    """A waiting spare, now running `argv` with `env` (the task's whole
    environment); a new spare starts in its place. None when no spare
    waits, or `argv` runs something else than `prefix -m module`."""
    split = _split_module_command(argv)
    if split is None or split[0] != self._prefix or _wants_native_logs(
        split[2]):
      return None
    while self._waiting:
      process = self._waiting.pop(0)
      if process.poll() is not None:
        continue  # It died waiting (the OOM killer): not for a task.
      order = json.dumps({"module": split[1], "args": split[2],
                          "env": dict(env)})
      try:
        process.stdin.write((order + "\n").encode())
        process.stdin.close()
      except OSError:
        continue
      self._waiting.append(self._start_one())
      return process
    return None

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


if __name__ == "__main__":
  main()
