"""A task over ssh: the shell line it runs on its host, and its local ssh
process, which the launcher's Job drives as any process (signals go to
the remote task by its pid)."""

import shlex
import signal
import subprocess
import time


# The first line a remote task prints: its pid (the shell's, which
# becomes the task's with exec).
_PID_LINE = "tfdist-remote-pid "


def scratch_path(name):
  """The shell words of directory `name` in the host's own TMPDIR."""
  return '"${TMPDIR:-/tmp}"/' + shlex.quote(name)


def remote_line(args, env, module, module_args=(), scratch=None):
  """The shell line that runs `python -m module` on a remote host: in
  --workdir, after the pid line (exec: the shell's pid is the task's).
  `scratch`: the name of its TMPDIR there, a directory in the host's own,
  made first, which the launcher removes at its end (remove_remote),
  also after a task was killed."""
  variables = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
  if scratch:
    variables = f"TMPDIR={scratch_path(scratch)} {variables}"
  rest = " ".join(shlex.quote(a) for a in module_args)
  made = f"mkdir -p {scratch_path(scratch)} && " if scratch else ""
  return (f"cd {shlex.quote(args.workdir)} && {made}echo {_PID_LINE}$$ && "
          f"{variables} exec {shlex.quote(args.python)} -m {module} {rest}")


def remote_command(args, spec):
  """The shell line run on the remote host for one task."""
  return remote_line(args, spec.env, args.module, args.train_args,
                     scratch=args.remote_scratch)


def remove_remote(args, paths, log, timeout=60):
  """Removes each (host, shell path) of `paths` over ssh, all at once,
  within `timeout` seconds in all; a host that does not answer (gone,
  or unreachable) is named."""
  removing = [(host, path, subprocess.Popen(
      [*ssh_prefix(args, "-o", "ConnectTimeout=10"), host, f"rm -rf {path}"],
      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL)) for host, path in paths]
  deadline = time.monotonic() + timeout
  for host, path, process in removing:
    try:
      process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
      log(f"could not remove {host}:{path} (no answer within {timeout} s).")


class RemoteProcess:
  """The local ssh process of one task, as the launcher's Job sees a
  process, but for signals: those go to the remote task by its pid."""

  def __init__(self, local, ssh_prefix, host):
    self._local = local
    self._kill_argv = [*ssh_prefix, host]
    self._remote_pid = None
    self._signallers = []
    self.pid = local.pid
    self.stdout = self._lines()

  def _lines(self):
    for raw in self._local.stdout:
      text = raw.decode("utf-8", "replace").rstrip("\r\n")
      if self._remote_pid is None and text.startswith(_PID_LINE):
        self._remote_pid = int(text[len(_PID_LINE):])
        continue
      yield (text + "\n").encode()

  @property
  def returncode(self):
    return self._local.returncode

  @property
  def stdin(self):
    return self._local.stdin  # A spare's: its order, then its session.

  def poll(self):
    return self._local.poll()

  def wait(self, timeout=None):
    code = self._local.wait(timeout=timeout)
    if self._local.stdin:
      self._local.stdin.close()
    for signaller in self._signallers:  # A host gone may never answer.
      try:
        signaller.wait(timeout=10)
      except subprocess.TimeoutExpired:
        signaller.kill()
        signaller.wait()
    self._signallers = []
    return code

  def send_signal(self, signum):
    if self._remote_pid is None or self._local.poll() is not None:
      self._local.send_signal(signum)  # Not started yet, or gone.
      return
    self._signallers.append(subprocess.Popen(
        [*self._kill_argv, f"kill -{int(signum)} {self._remote_pid}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL))

  def terminate(self):
    self.send_signal(signal.SIGTERM)

  def kill(self):
    self.send_signal(signal.SIGKILL)
    self._local.kill()


def ssh_prefix(args, *options):
  """ssh with `options` and then the user's --ssh_args."""
  return ["ssh", *options, *shlex.split(args.ssh_args)]
