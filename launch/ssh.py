"""SSH launcher: one task per host, each started over ssh with its
TF_CONFIG, output prefixed with `role:index`.

python -m launch.ssh --hosts=h1,h2[,...] [--chief] [--workers=N] [--ps=M]
    [--evaluator] [--port=2222] [--ssh_args='-p 22 -i KEY'] [--workdir=DIR]
    [--python=python] [--max_restarts=K] -- <tfdist.train flags>

It takes the same cluster description as every launcher. Hosts take the
tasks in order: the chief (with --chief), the workers, the ps tasks, then
the evaluator; without --workers, every host left is a worker. A host
listed twice runs two tasks, on ports --port and --port+1. ssh runs with a forced tty (-tt), so when the
launcher stops a task, or gets Ctrl-C, the remote process gets SIGHUP and
ends with its session. Failures restart the job by the shared policy of launch.core.
"""

import argparse
import shlex
import sys

from . import core
from . import description
from tfdist import cluster


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m launch.ssh")
  parser.add_argument("--hosts", required=True,
                      help="Comma-separated hosts, one task each.")
  description.add_arguments(parser, workers_default=None)
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
  if args.workers is None:
    args.workers = (len(hosts) - int(args.chief) - args.ps -
                    int(args.evaluator))
  core.finish_args(parser, args)
  try:
    tasks = sum(args.cluster.counts().values())
    if tasks != len(hosts):
      raise ValueError(f"--hosts lists {len(hosts)} host(s) for {tasks} "
                       f"task(s) {args.cluster.counts()}; give one host per "
                       "task (a host may repeat).")
    args.addresses = _role_addresses(args.cluster, hosts, args.port)
  except (ValueError, cluster.ClusterError) as e:
    parser.error(str(e))
  return args


def _role_addresses(desc, hosts, port):
  addresses = list(cluster.addresses_from_hosts(hosts, port))
  roles = {}
  for role, count in desc.counts().items():
    roles[role], addresses = addresses[:count], addresses[count:]
  return roles


def remote_command(args, spec):
  """The shell line run on the remote host for one task."""
  env = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
  train = " ".join(shlex.quote(a) for a in args.train_args)
  return (f"cd {shlex.quote(args.workdir)} && {env} exec "
          f"{shlex.quote(args.python)} -m {args.module} {train}")


def ssh_tasks(args):
  specs = description.task_commands(
      args.cluster, addresses=args.addresses, module=args.module,
      train_args=args.train_args)
  return [description.TaskSpec(
      role=s.role, index=s.index, address=s.address, env={},
      argv=["ssh", "-tt", *shlex.split(args.ssh_args),
            s.address.rpartition(":")[0], remote_command(args, s)])
          for s in specs]


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  sys.exit(core.Launcher(args, make_tasks=ssh_tasks).run())


if __name__ == "__main__":
  main()
