"""SSH launcher: one task per host, each started over ssh with its
TF_CONFIG, output prefixed with `role:index`.

python -m launch.ssh --hosts=h1,h2[,...] [--chief] [--workers=N] [--ps=M]
    [--evaluator] [--port=2222] [--ssh_args='-p 22 -i KEY'] [--workdir=DIR]
    [--python=python] [--max_restarts=K] -- <tfdist.train flags>
python -m launch.ssh --workers=MIN:MAX --host_discovery=SCRIPT
    [--hosts=CHIEF,PS...] ... -- <tfdist.train flags>

It takes the same cluster description as every launcher. Hosts take the
tasks in order: the chief (with --chief), the workers, the ps tasks, then
the evaluator; without --workers, every host left is a worker. A host
listed twice runs two tasks, on ports --port and --port+1. ssh runs with a
forced tty (-tt), so that a remote task ends with its session. A signal
for a task (SIGTERM to save and stop, Ctrl-C's SIGINT) is sent to the
remote process itself, over a second ssh (`kill`), by the pid it printed
at its start: the task then saves, exits with its own code, and ssh
brings that code back. (Killing the local ssh would give the remote task
SIGHUP, and its output nowhere to go.) Failures restart the job by the
shared policy of launch.core.

Elastic (--workers=MIN:MAX): the workers' hosts are the worker part of
--hosts, or, with --host_discovery, the 'host:slots' lines the script
prints (--hosts then lists only the chief, ps and evaluator hosts). A
worker dropped for good gives up its slot until discovery offers it again.
"""

import argparse
import dataclasses
import os
import shlex
import signal
import subprocess
import sys

from . import core
from . import description
from . import processes
from tfdist import cluster


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m launch.ssh")
  parser.add_argument("--hosts", default="",
                      help="Comma-separated hosts, one task each: the chief, "
                      "the workers, the ps tasks, the evaluator. With "
                      "--host_discovery, no workers.")
  description.add_arguments(parser, workers_default=None, elastic=True)
  core.add_discovery_arguments(parser, hosts_help="")
  parser.add_argument("--port", type=int, default=2222,
                      help="First TF port on each host.")
  parser.add_argument("--ssh_args", default="",
                      help="Extra ssh arguments, e.g. '-p 2022 -i key'.")
  parser.add_argument("--workdir", default=".",
                      help="Remote directory to run in.")
  parser.add_argument("--python", default="python",
                      help="Remote Python that has tfdist installed.")
  core.add_restart_arguments(parser)
  args = parser.parse_args(argv)
  hosts = [h for h in args.hosts.split(",") if h]
  others = int(args.chief) + args.ps + int(args.evaluator)
  if args.workers is None:
    args.workers = len(hosts) - others
  core.finish_args(parser, args)
  try:
    args.worker_hosts, args.role_hosts = _split_hosts(args, hosts)
    if not args.host_discovery:
      workers = len(args.worker_hosts)
      if args.cluster.elastic:
        # Start on every worker host given; MIN:MAX bounds that count.
        low, high = args.cluster.min_workers, args.cluster.max_workers
        if not low <= workers <= high:
          raise ValueError(f"--hosts names {workers} worker host(s), "
                           f"outside --workers={low}:{high}. Received: "
                           f"--hosts={args.hosts}")
        args.cluster = dataclasses.replace(args.cluster, workers=workers)
      elif workers != args.cluster.workers:
        raise ValueError(
            f"--hosts lists {len(hosts)} host(s) for "
            f"{sum(args.cluster.counts().values())} task(s) "
            f"{args.cluster.counts()}; give one host per task (a host may "
            "repeat).")
    cluster.addresses_from_hosts(hosts, args.port)  # Checks the port.
  except (ValueError, cluster.ClusterError) as e:
    parser.error(str(e))
  return args


def _split_hosts(args, hosts):
  """(worker hosts, {role: hosts} of the other roles) from --hosts, in
  the order chief, workers, ps, evaluator; with --host_discovery it
  names no worker."""
  others = int(args.chief) + args.ps + int(args.evaluator)
  if args.host_discovery and len(hosts) != others:
    raise ValueError(f"with --host_discovery, --hosts lists only the "
                     f"{others} chief, ps and evaluator host(s). Received: "
                     f"--hosts={','.join(hosts)}")
  if len(hosts) < others + (0 if args.host_discovery else 1):
    raise ValueError(f"--hosts lists {len(hosts)} host(s); the chief, ps "
                     f"and evaluator take {others} and a job needs a "
                     "worker.")
  chief, rest = hosts[:int(args.chief)], hosts[int(args.chief):]
  workers = rest[:len(rest) - args.ps - int(args.evaluator)]
  tail = rest[len(workers):]
  return workers, {"chief": chief, "ps": tail[:args.ps],
                   "evaluator": tail[args.ps:]}


class WorkerHosts:
  """The worker slots, in order: the worker hosts --hosts names, or,
  with a discovery `command`, the hosts it offers (a host with k slots
  runs up to k workers). Workers take the first slots. The discovery
  script is the truth: a slot dropped after a failure comes back when
  the script offers it again."""

  def __init__(self, hosts, *, command="", min_workers=1, log=print):
    self._hosts = list(hosts)
    self._command = command
    self._min_workers = min_workers
    self._log = log

  def discover(self):
    """Runs the discovery command; returns the number of slots it
    offers, or None when it cannot tell. An offer below MIN is not
    taken: the running group keeps its hosts."""
    offered = core.discover_hosts(self._command, self._log)
    if offered is None:
      return None
    hosts = [host for host, slots in offered for _ in range(slots)]
    if len(hosts) >= self._min_workers:
      self._hosts = hosts
    return len(hosts)

  def drop(self, spec):
    """The worker of TaskSpec `spec` is dropped: a slot of its host goes
    (unless a discovery since then has already left the host out)."""
    host = spec.address.rpartition(":")[0]
    if host in self._hosts:
      self._hosts.remove(host)

  def take(self, count):
    if count > len(self._hosts):
      raise ValueError(f"{count} workers need {count} worker slots; "
                       f"{len(self._hosts)} are known: {self._hosts}")
    return self._hosts[:count]


def _role_addresses(desc, hosts, port):
  addresses = list(cluster.addresses_from_hosts(hosts, port))
  roles = {}
  for role, count in desc.counts().items():
    roles[role], addresses = addresses[:count], addresses[count:]
  return roles


# The first line a remote task prints: its pid (the shell's, which
# becomes the task's with exec).
_PID_LINE = "tfdist-remote-pid "


def remote_command(args, spec):
  """The shell line run on the remote host for one task."""
  env = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
  train = " ".join(shlex.quote(a) for a in args.train_args)
  return (f"cd {shlex.quote(args.workdir)} && echo {_PID_LINE}$$ && "
          f"{env} exec {shlex.quote(args.python)} -m {args.module} {train}")


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

  def poll(self):
    return self._local.poll()

  def wait(self, timeout=None):
    code = self._local.wait(timeout=timeout)
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


def spawn(args):
  """Job's spawn for ssh tasks: RemoteProcess around each local ssh."""
  prefix = ["ssh", *shlex.split(args.ssh_args)]

  def start(spec, env):
    return RemoteProcess(
        processes.start_local(spec.argv, {**os.environ, **env}), prefix,
        spec.address.rpartition(":")[0])
  return start


def ssh_tasks(args, worker_hosts):
  """The TaskSpecs of one attempt: args.cluster's workers on the first
  hosts of `worker_hosts` (a WorkerHosts)."""
  roles = args.role_hosts
  hosts = (roles["chief"] + worker_hosts.take(args.cluster.workers) +
           roles["ps"] + roles["evaluator"])
  specs = description.task_commands(
      args.cluster, addresses=_role_addresses(args.cluster, hosts,
                                              args.port),
      module=args.module, train_args=args.train_args)
  return [description.TaskSpec(
      role=s.role, index=s.index, address=s.address, env={},
      argv=["ssh", "-tt", *shlex.split(args.ssh_args),
            s.address.rpartition(":")[0], remote_command(args, s)])
          for s in specs]


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)

  def log(message):
    processes.write_line(sys.stdout, f"[launch] {message}")

  hosts = WorkerHosts(args.worker_hosts, command=args.host_discovery,
                      min_workers=args.cluster.min_workers or 1, log=log)
  sys.exit(core.Launcher(
      args, make_tasks=lambda a: ssh_tasks(a, hosts),
      discover=hosts.discover if args.host_discovery else None,
      discover_every_seconds=args.discovery_seconds,
      drop_worker=hosts.drop, spawn=spawn(args)).run())


if __name__ == "__main__":
  main()
