"""Local cluster launcher: one process per task on 127.0.0.1.

python -m launch.local --workers=2 [--chief] [--ps=N] [--evaluator]
    [--max_restarts=K] [--backoff_seconds=S] -- <tfdist.train flags>
python -m launch.local --workers=MIN:MAX [--host_discovery=SCRIPT] -- ...
python -m launch.local --data_workers=K ... -- ...   (a tf.data service)

Every task gets its own TF_CONFIG (built by tfdist.cluster) and every output
line is prefixed with `role:index`. Failures, restarts and signals follow
the shared policy of launch.core; no task outlives the launcher.
"""

import argparse
import contextlib
import dataclasses
import sys
import tempfile

import portpicker

from . import arguments
from . import core
from . import data_service
from . import description
from . import isolation
from . import membership
from . import processes
from . import spare


def parse_args(argv):
  parser = argparse.ArgumentParser(
      prog="python -m launch.local",
      description="Run a tfdist job as local processes on 127.0.0.1.")
  description.add_arguments(parser, elastic=True)
  arguments.add_discovery_arguments(
      parser, hosts_help="; here every host is this machine")
  parser.add_argument("--isolate", choices=("auto", "on", "off"),
                      default="auto",
                      help="Run the tasks in a private network namespace, "
                      "so their gRPC ports are reachable from nowhere else "
                      "(needs root). auto: when possible (default).")
  spare.add_argument(parser)
  description.add_data_workers_argument(parser)
  arguments.add_restart_arguments(parser)
  args = parser.parse_args(argv)
  arguments.finish_args(parser, args)
  # Per task: every task is on this machine.
  args.spare_count = spare.count_from(parser, args) * sum(
      args.cluster.counts().values())
  return args


def discover_slots(command, log):
  """The worker slots `command` offers, summed over its hosts (all of
  them this machine); None when it cannot tell."""
  hosts = membership.discover_hosts(command, log)
  return None if hosts is None else sum(slots for _, slots in hosts)


def _local_addresses(cluster):
  """Fresh free ports on 127.0.0.1 for every task, every attempt."""
  return {role: [f"127.0.0.1:{portpicker.pick_unused_port()}"
                 for _ in range(count)]
          for role, count in cluster.counts().items()}


def local_tasks(args, network=None):
  """The TaskSpecs of one attempt: local processes, inside `network` (a
  launch.isolation.PrivateNetwork) if given."""
  specs = description.task_commands(
      args.cluster, addresses=_local_addresses(args.cluster),
      module=args.module, train_args=args.train_args)
  if network is None:
    return specs
  return [dataclasses.replace(s, argv=network.wrap(s.argv)) for s in specs]


@contextlib.contextmanager
def _data_service(args, python, log):
  """With --data_workers: a dispatcher and its data workers for the whole
  run (every attempt), the trainers told where it is."""
  if not args.cluster.data_workers:
    yield None
    return
  port = portpicker.pick_unused_port()
  with tempfile.TemporaryDirectory(prefix="tfdist-dispatcher-") as work_dir:
    service = data_service.DataService(
        commands_by_name=data_service.commands(
            python=python, port=port, work_dir=work_dir,
            data_workers=args.cluster.data_workers),
        start_process=lambda _, argv, env: processes.start_local(argv, env),
        log=log, on_give_up=data_service.stop_launcher,
        write=lambda name, line: processes.write_line(
            sys.stdout, f"{name} | {line}"))
    try:
      service.start()
    except (RuntimeError, OSError) as e:  # OSError: a process not started.
      service.close()
      sys.exit(f"python -m launch.local: error: {e}")
    args.train_args = [*args.train_args,
                       f"--data_service=grpc://127.0.0.1:{port}"]
    try:
      yield service
    finally:
      service.close()


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  def log(message):
    processes.write_line(sys.stdout, f"[launch] {message}")
  try:
    network = isolation.open_for(args.isolate, log)
  except RuntimeError as e:
    sys.exit(f"python -m launch.local: error: {e}")
  try:
    discover = None
    if args.host_discovery:
      discover = lambda: discover_slots(args.host_discovery, log)  # pylint: disable=unnecessary-lambda-assignment
    python = [sys.executable] if network is None else network.wrap(
        [sys.executable])
    spares = (spare.Spares(command=[*python, "-m", spare.MODULE],
                           count=args.spare_count,
                           start_process=processes.start_spare, log=log)
              if args.spare_count else None)
    with _data_service(args, python, log):
      code = core.Launcher(
          args, make_tasks=lambda a: local_tasks(a, network),
          discover=discover, discover_every_seconds=args.discovery_seconds,
          spares=spares).run()
  finally:
    if network:
      network.close()
  sys.exit(code)


if __name__ == "__main__":
  main()
