"""The Ray side of launch.ray: an actor that runs one task process, and a
Popen-like handle for it on the launcher's side, so that launch.core's
Job drives Ray tasks exactly as it drives local processes.

Only the standard library and ray: the actor class is shipped to Ray's
workers by value, so they need no tfdist install on the node.
"""

import collections
import functools
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import ray
from ray import cloudpickle

from . import spare_order  # pylint: disable=g-bad-import-order

# Ray's workers import nothing of ours: send this module's code along,
# and the spare order's.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(spare_order)

_PR_SET_PDEATHSIG = 1
# What poll() reports when the actor itself is gone: the task was killed.
ACTOR_LOST_CODE = -signal.SIGKILL


def load_libc():
  """libc, resolved in the parent: a dlopen in a forked child, with other
  threads alive, can deadlock on the loader's lock. None if not Linux."""
  import ctypes
  try:
    return ctypes.CDLL("libc.so.6", use_errno=True)
  except OSError:
    return None


def child_preparer():
  """A preexec_fn for Popen, with libc resolved here, before the fork."""
  return functools.partial(prepare_child, load_libc())


def prepare_child(libc):
  """In a child forked in a Ray worker: die with the forking thread (the
  actor's spawner, or a Tune trial's), and take back the signals that
  Ray's worker threads block or ignore (both survive exec, so a forwarded
  Ctrl-C or SIGTERM would do nothing)."""
  import ctypes
  signal.pthread_sigmask(signal.SIG_SETMASK, set())
  if libc is None:
    return
  libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  for signum in (signal.SIGINT, signal.SIGTERM):
    libc.signal(signum, ctypes.c_void_p(int(signal.SIG_DFL)))


@ray.remote(num_cpus=0, max_restarts=0)
class TaskActor:
  """Runs one task process on its bundle's node."""

  def __init__(self):
    self._process = None
    self._lines = collections.deque()
    self._reader = None
    self._scratch = None
    # PR_SET_PDEATHSIG fires when the *thread* that forked the child ends,
    # and Ray runs actor methods in threads: fork from a thread that lives
    # exactly as long as this actor's process.
    self._requests = queue.Queue()
    self._spare = None  # A warm spare (launch.spare) waiting for start().
    threading.Thread(target=self._spawner, daemon=True).start()

  def _spawner(self):
    while True:
      argv, env, cwd, stdin, reply = self._requests.get()
      try:
        reply.put(subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=stdin,
            start_new_session=True, preexec_fn=child_preparer()))
      except OSError as e:
        reply.put(e)

  def _popen(self, argv, env, cwd, stdin=subprocess.DEVNULL):
    reply = queue.Queue()
    self._requests.put((argv, env, cwd if os.path.isdir(cwd) else None,
                        stdin, reply))
    process = reply.get()
    if isinstance(process, OSError):
      raise process
    return process

  def warm(self, module, env, cwd):
    """Starts a warm spare, `python -m module` (launch.spare), that the
    next start() hands its task to; returns its pid."""
    self._spare = self._popen([sys.executable, "-m", module],
                              {**os.environ, **env}, cwd,
                              stdin=subprocess.PIPE)
    return self._spare.pid

  def spare_exit(self):
    """None while the spare waits; else why not (its code and last line:
    a node without tfdist says so here)."""
    if self._spare is None:
      return "no spare"
    code = self._spare.poll()
    if code is None:
      return None
    last = spare_order.last_words(self._spare)
    return f"exited with code {code}: {last or 'no output'}"

  def _hand_to_spare(self, argv, env):
    """The spare, now running `python -m module args` with `env`, or None
    (no spare waits, or argv is not a module's); a spare that cannot
    take its order is killed."""
    spare, self._spare = self._spare, None
    if spare is None or spare.poll() is not None or argv[1:2] != ["-m"]:
      return None
    order = spare_order.order_line(module=argv[2], args=argv[3:], env=env,
                                   remote=False)
    try:
      spare.stdin.write(order)
      spare.stdin.close()
    except OSError:
      spare.kill()
      spare.wait()
      return None
    return spare

  def address(self):
    """This node's IP and a port free on it now (the task binds it later;
    see launch.core for a port taken in between)."""
    ip = ray.util.get_node_ip_address()
    with socket.socket() as probe:
      probe.bind((ip, 0))
      return f"{ip}:{probe.getsockname()[1]}"

  def node_id(self):
    """The Ray node this actor runs on."""
    return ray.get_runtime_context().get_node_id()

  def start(self, argv, env, cwd, warm_only=False, scratch_root=None):
    """Starts `argv` with this node's Python; returns (pid, actor pid).
    `warm_only`: on this actor's spare, else nothing starts and it
    returns None (the launcher starts it cold in the task's bundle).
    `scratch_root`: the launcher's directory for the tasks' scratch
    directories, used where it exists (the launcher's machine): the
    launcher removes it, also after an actor killed with its node."""
    scratch = _scratch_dir(scratch_root)
    env = {**os.environ, **env, "TMPDIR": scratch}
    argv = [sys.executable, *argv[1:]]
    process = self._hand_to_spare(argv, env)
    if process is None and warm_only:
      shutil.rmtree(scratch, ignore_errors=True)
      return None
    self._scratch = scratch
    self._process = process = process or self._popen(argv, env, cwd)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    return process.pid, os.getpid()

  def _read(self):
    for raw in self._process.stdout:
      self._lines.append(raw)

  def read(self, max_lines=500):
    """Output lines so far, and whether there will be no more."""
    lines = []
    while self._lines and len(lines) < max_lines:
      lines.append(self._lines.popleft())
    done = (not self._lines and self._reader is not None
            and not self._reader.is_alive())
    return lines, done

  def poll(self):
    return self._process.poll()

  def send_signal(self, signum):
    if self._process.poll() is None:
      self._process.send_signal(signum)

  def cleanup(self):
    """Kills the task (or the spare) if it still runs and removes its
    scratch files."""
    for process in (self._process, self._spare):
      if process is not None and process.poll() is None:
        process.kill()
        process.wait()
    if self._scratch:
      shutil.rmtree(self._scratch, ignore_errors=True)


def _scratch_dir(root):
  """A task's scratch directory: in `root` where this node can make one
  there (the launcher's machine, as its user), else in its temp dir."""
  if root and os.path.isdir(root):
    try:
      return tempfile.mkdtemp(prefix="tfdist-ray-task-", dir=root)
    except OSError:  # Another user's node on the launcher's machine.
      pass
  return tempfile.mkdtemp(prefix="tfdist-ray-task-")


def alive(ray_module, actor):
  try:
    ray_module.get(actor.address.remote(), timeout=30)
    return True
  except (ray_module.exceptions.RayActorError,
          ray_module.exceptions.GetTimeoutError):
    return False


def release(ray_module, actor):
  """Ends the actor; its task process, if any, dies with it."""
  try:
    ray_module.get(actor.cleanup.remote(), timeout=30)
  except (ray_module.exceptions.RayError, ray_module.exceptions.GetTimeoutError):
    pass
  ray_module.kill(actor)


class NoSpare(Exception):
  """A spare actor's spare could not take its task."""


class RemoteProcess:
  """A task process in an actor, seen as a subprocess.Popen: pid, poll(),
  wait(), send_signal(), kill(), and stdout to iterate over."""

  def __init__(self, ray_module, actor, argv, env, *, cwd, warm_only=False,
               scratch_root=None):
    self._ray = ray_module
    self._actor = actor
    self._returncode = None
    self.lost = False  # The actor is gone (its node, say), not just exited.
    started = ray_module.get(actor.start.remote(argv, env, cwd, warm_only,
                                                scratch_root))
    if started is None:
      raise NoSpare("the spare could not take the task")
    self.pid, self.actor_pid = started
    self.stdout = self._lines()

  def _call(self, method, *args):
    """The method's result, or None with the exit code set to
    ACTOR_LOST_CODE when the actor is gone."""
    try:
      return self._ray.get(getattr(self._actor, method).remote(*args))
    except self._ray.exceptions.RayActorError:
      if self._returncode is None:
        self._returncode = ACTOR_LOST_CODE
        self.lost = True
      return None

  def _lines(self):
    while True:
      result = self._call("read")
      if result is None:
        return
      lines, done = result
      yield from lines
      if done:
        return
      if not lines:
        time.sleep(0.1)

  def poll(self):
    if self._returncode is None:
      code = self._call("poll")
      # A lost actor set the code inside _call: None must not undo it.
      if self._returncode is None:
        self._returncode = code
    return self._returncode

  def wait(self, timeout=None):
    deadline = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
      if deadline is not None and time.monotonic() > deadline:
        raise subprocess.TimeoutExpired("ray task", timeout)
      time.sleep(0.1)
    return self._returncode

  def send_signal(self, signum):
    if self.poll() is None:
      self._call("send_signal", signum)

  def kill(self):
    self.send_signal(signal.SIGKILL)
