"""Local cluster launcher: one process per task on 127.0.0.1.

python -m launch.local --workers=2 [--chief] [--ps=N] [--evaluator]
    [--max_restarts=K] [--backoff_seconds=S] -- <tfdist.train flags>
python -m launch.local --workers=MIN:MAX [--host_discovery=SCRIPT] -- ...

Every task gets its own TF_CONFIG (built by tfdist.cluster) and every output
line is prefixed with `role:index`. Failures, restarts and signals follow
the shared policy of launch.core; no task outlives the launcher.
"""

import argparse
import dataclasses
import subprocess
import sys

import portpicker

from . import core
from . import description
from . import isolation
from . import processes


def parse_args(argv):
  parser = argparse.ArgumentParser(
      prog="python -m launch.local",
      description="Run a tfdist job as local processes on 127.0.0.1.")
  description.add_arguments(parser, elastic=True)
  parser.add_argument("--host_discovery", default="",
                      help="With --workers=MIN:MAX: a command that prints "
                      "the hosts that can run workers now, one 'host:slots' "
                      "line each (Horovod's format; here every host is "
                      "this machine). Run every --discovery_seconds.")
  parser.add_argument("--discovery_seconds", type=float, default=5.0,
                      help="How often to run --host_discovery.")
  parser.add_argument("--isolate", choices=("auto", "on", "off"),
                      default="auto",
                      help="Run the tasks in a private network namespace, "
                      "so their gRPC ports are reachable from nowhere else "
                      "(needs root). auto: when possible (default).")
  core.add_restart_arguments(parser)
  args = parser.parse_args(argv)
  core.finish_args(parser, args)
  if args.host_discovery and not args.cluster.elastic:
    parser.error("--host_discovery needs --workers=MIN:MAX. Received: "
                 f"--workers={args.workers}")
  if args.cluster.elastic and not args.cluster.ps:
    _check_batch_divides(parser, args)
  return args


def _check_batch_divides(parser, args):
  """An elastic MWMS job keeps its global batch: every worker count from
  MIN to MAX must divide a --batch_size given on the command line."""
  sizes = [a.split("=", 1)[1] for a in args.train_args
           if a.startswith("--batch_size=")]
  if not sizes or not sizes[-1].isdigit():
    return  # A flagfile or the default: the tasks check it.
  batch = int(sizes[-1])
  bad = [n for n in range(args.cluster.min_workers,
                          args.cluster.max_workers + 1) if batch % n]
  if bad:
    parser.error(f"--workers={args.cluster.min_workers}:"
                 f"{args.cluster.max_workers} keeps the global batch, which "
                 f"{', '.join(map(str, bad))} worker(s) cannot split. "
                 f"Received: batch_size={batch}")


def discover_slots(command, log):
  """The worker slots `command` offers: the sum of its 'host:slots'
  lines; None (and a log line) when it fails or prints nothing usable."""
  try:
    proc = subprocess.run(command, shell=True, capture_output=True,
                          text=True, timeout=30)
  except subprocess.TimeoutExpired:
    log(f"--host_discovery did not answer within 30s: {command}")
    return None
  slots = 0
  for line in proc.stdout.split():
    host, _, count = line.rpartition(":")
    if not host or not count.isdigit():
      log(f"--host_discovery printed {line!r}, not host:slots; ignored.")
      return None
    slots += int(count)
  if proc.returncode:
    log(f"--host_discovery exited {proc.returncode}; ignored.")
    return None
  return slots


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
    code = core.Launcher(
        args, make_tasks=lambda a: local_tasks(a, network),
        discover=discover,
        discover_every_seconds=args.discovery_seconds).run()
  finally:
    if network:
      network.close()
  sys.exit(code)


if __name__ == "__main__":
  main()
