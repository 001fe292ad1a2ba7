"""SSH launcher: one task per host, each started over ssh with its
TF_CONFIG, output prefixed with `role:index`.

python -m launch.ssh --hosts=h1,h2[,...] [--chief] [--workers=N] [--ps=M]
    [--evaluator] [--port=2222] [--ssh_args='-p 22 -i KEY'] [--workdir=DIR]
    [--python=python] [--max_restarts=K] [--spares=auto|N]
    [--data_workers=K --data_hosts=H1[,H2...] [--dispatcher_port=5050]]
    -- <tfdist.train flags>
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

Warm spares (--spares, auto: one per task when the job can restart):
spares (launch.spare) wait on each host the tasks run on, over `ssh -T`,
and a restart, preemption resume or membership change hands the tasks of
that host to them; new ones start in their places.

A tf.data service (--data_workers=K): a dispatcher on the first of
--data_hosts, on --dispatcher_port, its journal in a directory of that
host's /tmp, and K data workers spread over --data_hosts in turn, each
over `ssh -tt` and restarted when it ends (launch.data_service); the
trainers get --data_service.

Elastic (--workers=MIN:MAX): the workers' hosts are the worker part of
--hosts, or, with --host_discovery, the 'host:slots' lines the script
prints (--hosts then lists only the chief, ps and evaluator hosts). A
worker dropped for good gives up its slot until discovery offers it again.
"""

import argparse
import dataclasses
import os
import secrets
import shlex
import sys

from . import arguments
from . import core
from . import data_service
from . import description
from . import processes
from . import spare
from . import ssh_hosts
from . import ssh_remote
from tfdist import cluster


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m launch.ssh")
  parser.add_argument("--hosts", default="",
                      help="Comma-separated hosts, one task each: the chief, "
                      "the workers, the ps tasks, the evaluator. With "
                      "--host_discovery, no workers.")
  description.add_arguments(parser, workers_default=None, elastic=True)
  arguments.add_discovery_arguments(parser, hosts_help="")
  parser.add_argument("--port", type=int, default=2222,
                      help="First TF port on each host.")
  parser.add_argument("--ssh_args", default="",
                      help="Extra ssh arguments, e.g. '-p 2022 -i key'.")
  parser.add_argument("--workdir", default=".",
                      help="Remote directory to run in.")
  parser.add_argument("--python", default="python",
                      help="Remote Python that has tfdist installed.")
  spare.add_argument(parser)
  description.add_data_workers_argument(parser)
  parser.add_argument("--data_hosts", default="",
                      help="With --data_workers: comma-separated hosts of "
                      "the tf.data service, the dispatcher on the first.")
  parser.add_argument("--dispatcher_port", type=int, default=5050)
  arguments.add_restart_arguments(parser)
  args = parser.parse_args(argv)
  args.data_hosts = [h for h in args.data_hosts.split(",") if h]
  # The dispatcher's work_dir on its host, and the tasks' TMPDIR on
  # theirs: one per launcher, removed at its end.
  # (A random part: another launcher's pid may be the same.)
  args.dispatcher_journal = (f"/tmp/tfdist-dispatcher-{os.getpid()}-"
                             f"{secrets.token_hex(4)}")
  args.remote_scratch = f"tfdist-ssh-{os.getpid()}-{secrets.token_hex(4)}"
  args.scratch_hosts = set()  # Hosts a task or spare ran on.
  if bool(args.data_workers) != bool(args.data_hosts):
    parser.error("--data_workers and --data_hosts go together. Received: "
                 f"--data_workers={args.data_workers}, "
                 f"--data_hosts={','.join(args.data_hosts)}")
  hosts = [h for h in args.hosts.split(",") if h]
  others = int(args.chief) + args.ps + int(args.evaluator)
  if args.workers is None:
    args.workers = len(hosts) - others
  arguments.finish_args(parser, args)
  args.spares_per_task = spare.count_from(parser, args)
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


def _role_addresses(desc, hosts, port):
  addresses = list(cluster.addresses_from_hosts(hosts, port))
  roles = {}
  for role, count in desc.counts().items():
    roles[role], addresses = addresses[:count], addresses[count:]
  return roles


# A waiting spare's connection: ssh ends within 2 minutes when the host
# is gone (then the spare is not handed a task), where TCP would take
# far longer. Loose enough that a task on it rides out a stall of the
# network as one over `ssh -tt` would. The user's --ssh_args win.
_SPARE_KEEPALIVE = ["-o", "ServerAliveInterval=15", "-o",
                    "ServerAliveCountMax=8"]


def spare_command(args, host):
  """A warm spare on `host`, over ssh without a tty (its stdin carries
  the order); unbuffered, as its output is a pipe."""
  return [*ssh_remote.ssh_prefix(args, "-T"), *_SPARE_KEEPALIVE, host,
          ssh_remote.remote_line(args, {"PYTHONUNBUFFERED": "1"},
                                 spare.REMOTE_MODULE,
                                 scratch=args.remote_scratch)]


def host_spares(args, *, per_task, log):
  """launch.spare.Spares on every host the tasks run on (HostPools),
  each over ssh."""
  def make_pool(host):
    args.scratch_hosts.add(host)

    def start_process(command, env):
      return ssh_remote.RemoteProcess(processes.start_spare(command, env),
                                      ssh_remote.ssh_prefix(args), host)
    return spare.Spares(command=spare_command(args, host), count=0,
                        start_process=start_process, remote=True, log=log)
  return spare.HostPools(make_pool=make_pool, per_task=per_task)


def spawn(args, spares=None):
  """Job's spawn for ssh tasks: a spare of its host (host_spares), else
  RemoteProcess around a new local ssh. A spare gets the task's own
  variables there (`env`)."""
  def start(spec, env):
    host = spec.address.rpartition(":")[0]
    args.scratch_hosts.add(host)
    process = spares.pool(host).hand(
        module=args.module, args=args.train_args, env=env) if spares else None
    if process is not None:
      process.warm = True
      return process
    return ssh_remote.RemoteProcess(
        processes.start_local(spec.argv, dict(os.environ)),
        ssh_remote.ssh_prefix(args), host)
  return start


def ssh_tasks(args, worker_hosts, spares=None):
  """The TaskSpecs of one attempt: args.cluster's workers on the first
  hosts of `worker_hosts` (a WorkerHosts); `spares` (host_spares)
  learns the hosts."""
  roles = args.role_hosts
  hosts = (roles["chief"] + worker_hosts.take(args.cluster.workers) +
           roles["ps"] + roles["evaluator"])
  if spares:
    spares.plan(hosts)
  specs = description.task_commands(
      args.cluster, addresses=_role_addresses(args.cluster, hosts,
                                              args.port),
      module=args.module, train_args=args.train_args)
  # env: the task's own variables on its host (a spare's order); a new
  # ssh gets them on its command line.
  return [description.TaskSpec(
      role=s.role, index=s.index, address=s.address, env=s.env,
      argv=[*ssh_remote.ssh_prefix(args, "-tt"),
            s.address.rpartition(":")[0], ssh_remote.remote_command(args, s)])
          for s in specs]


def service_commands(args):
  """{name: ssh argv} of the tf.data service's processes: the dispatcher
  on the first data host, the data workers over them in turn."""
  hosts = args.data_hosts
  local = data_service.commands(
      python=[args.python], port=args.dispatcher_port, host=hosts[0],
      work_dir=args.dispatcher_journal,
      data_workers=args.cluster.data_workers,
      module=data_service.REMOTE_MODULE, worker_address="auto")
  env = {"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "1"}
  found = {}
  for index, (name, argv) in enumerate(local.items()):
    host = hosts[0] if name == "dispatcher" else hosts[(index - 1) %
                                                       len(hosts)]
    # The host by the name the trainers use: `auto` on the dispatcher's
    # own host could find a loopback address there (127.0.1.1 in hosts).
    rest = [f"--worker_address={host}:%port%" if a == "--worker_address=auto"
            else a for a in argv[3:]]
    found[name] = [*ssh_remote.ssh_prefix(args, "-tt"), host,
                   ssh_remote.remote_line(args, env, argv[2], rest)]
  return found


def _service(args, log):
  """The tf.data service of --data_workers over ssh, or None."""
  if not args.cluster.data_workers:
    return None

  def start_process(_, argv, env):
    return ssh_remote.RemoteProcess(processes.start_local(argv, env),
                                    ssh_remote.ssh_prefix(args), argv[-2])
  service = data_service.DataService(
      commands_by_name=service_commands(args), start_process=start_process,
      on_give_up=data_service.stop_launcher,
      log=log, write=lambda name, line: processes.write_line(
          sys.stdout, f"{name} | {line}"))
  args.train_args = [*args.train_args, "--data_service=grpc://"
                     f"{args.data_hosts[0]}:{args.dispatcher_port}"]
  return service


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)

  def log(message):
    processes.write_line(sys.stdout, f"[launch] {message}")

  service = _service(args, log)
  if service is None:
    sys.exit(_run(args, log))
  try:
    service.start()
  except (RuntimeError, OSError) as e:  # OSError: ssh not started.
    service.close()
    sys.exit(f"python -m launch.ssh: error: {e}")
  try:
    code = _run(args, log)
  finally:
    service.close()
    # The journal; its host may be the one that stopped answering.
    ssh_remote.remove_remote(
        args, [(args.data_hosts[0], shlex.quote(args.dispatcher_journal))],
        log)
  sys.exit(code)


def _run(args, log):
  """The job itself, restarted by launch.core's policy; then the tasks'
  TMPDIR on every host they ran on is removed."""
  try:
    return _run_job(args, log)
  finally:
    ssh_remote.remove_remote(
        args, [(host, ssh_remote.scratch_path(args.remote_scratch))
               for host in sorted(args.scratch_hosts)], log)


def _run_job(args, log):
  hosts = ssh_hosts.WorkerHosts(
      args.worker_hosts, command=args.host_discovery,
      min_workers=args.cluster.min_workers or 1, log=log)
  spares = (host_spares(args, per_task=args.spares_per_task, log=log)
            if args.spares_per_task else None)
  return core.Launcher(
      args, make_tasks=lambda a: ssh_tasks(a, hosts, spares),
      discover=hosts.discover if args.host_discovery else None,
      discover_every_seconds=args.discovery_seconds,
      drop_worker=hosts.drop, spawn=spawn(args, spares),
      spares=spares).run()


if __name__ == "__main__":
  main()
