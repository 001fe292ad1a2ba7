"""The flags every process-starting launcher shares (the restart policy's,
elastic discovery's) and their checks, with the train flags read as the
tasks will read them (absl, every form)."""

import argparse

from absl import flags

from . import description
from tfdist import options as tfdist_options


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


def add_discovery_arguments(parser, *, hosts_help):
  """--host_discovery and --discovery_seconds, for elastic launchers."""
  parser.add_argument("--host_discovery", default="",
                      help="With --workers=MIN:MAX: a command that prints "
                      "the hosts that can run workers now, one 'host:slots' "
                      "line each (Horovod's format)" + hosts_help +
                      ". Run every --discovery_seconds.")
  parser.add_argument("--discovery_seconds", type=float, default=5.0,
                      help="How often to run --host_discovery.")


class _Unreadable(Exception):
  """A flagfile this machine cannot read (it may exist on the hosts)."""


_OPTION_DEFAULT = object()


def _train_flag(train_args, name, default=_OPTION_DEFAULT):
  """The value tfdist.train takes for --`name` (a string): absl reads the
  train flags as the task will (every form: -name, --name value,
  flagfiles, a lone `--`); else `default` (the option's own by default).
  _Unreadable when a flagfile cannot be read here."""
  if default is _OPTION_DEFAULT:
    default = tfdist_options.BY_NAME[name].default
  values = flags.FlagValues()
  flags.DEFINE_string(name, None, "", flag_values=values)
  try:
    values(["train", *train_args], known_only=True)
  except (flags.CantOpenFlagFileError, UnicodeDecodeError):
    raise _Unreadable() from None
  except flags.Error:
    return default  # The task itself reports its bad flag.
  return values[name].value if values[name].present else default


def given_train_flag(train_args, name):
  """The value given for --`name` in the train flags (in either form, or
  in a flagfile read here), or None."""
  try:
    return _train_flag(train_args, name, default=None)
  except _Unreadable:
    return None


def _check_batch_divides(parser, args):
  """An elastic MWMS job keeps its global batch: every replica count of
  MIN to MAX workers (the chief, and each task's --num_cpu_devices,
  counted) must divide --batch_size, wherever it comes from."""
  try:
    batch = int(_train_flag(args.train_args, "batch_size"))
    per_task = int(_train_flag(args.train_args, "num_cpu_devices"))
  except (ValueError, _Unreadable):
    return  # The tasks check it, and say so in one line.
  chief = 1 if args.cluster.chief else 0
  bad = [n for n in range(args.cluster.min_workers,
                          args.cluster.max_workers + 1)
         if batch % ((n + chief) * per_task)]
  if bad:
    parser.error(f"--workers={args.cluster.min_workers}:"
                 f"{args.cluster.max_workers} keeps the global batch, which "
                 f"{', '.join(map(str, bad))} worker(s)"
                 f"{' and the chief' if chief else ''}"
                 f"{f' of {per_task} replicas each' if per_task > 1 else ''}"
                 f" cannot split. Received: batch_size={batch}")


def finish_args(parser, args):
  """Checks the shared flags and sets args.cluster from the description
  flags (launch.description), or exits with one parser error."""
  if args.train_args and args.train_args[0] == "--":
    args.train_args = args.train_args[1:]
  if args.max_restarts < 0:
    parser.error(f"--max_restarts must be >= 0. Received: "
                 f"{args.max_restarts}")
  try:
    args.cluster = description.from_args(args)
  except ValueError as e:
    parser.error(str(e))
  if getattr(args, "host_discovery", "") and not args.cluster.elastic:
    parser.error("--host_discovery needs --workers=MIN:MAX. Received: "
                 f"--workers={args.workers}")
  if getattr(args, "discovery_seconds", 1.0) <= 0:
    parser.error("--discovery_seconds must be > 0. Received: "
                 f"{args.discovery_seconds}")
  if getattr(args, "host_discovery", "") and args.cluster.ps:
    parser.error("--host_discovery cannot grow a parameter-server job: "
                 "its resize would stop the ps tasks before the chief "
                 "saves. Received: --host_discovery with "
                 f"--ps={args.cluster.ps}")
  if args.cluster.elastic and not args.cluster.ps:
    _check_batch_divides(parser, args)
  if args.cluster.data_workers:
    check_no_data_service(parser, args.train_args)


def check_no_data_service(parser, train_args):
  """--data_workers passes the service's address: one given in the train
  flags as well would be overridden, silently."""
  try:
    given = _train_flag(train_args, "data_service")
  except _Unreadable:
    return  # The task reports the flagfile.
  if given:
    parser.error("--data_workers starts a tf.data service and passes its "
                 "address: drop --data_service from the train flags. "
                 f"Received: --data_service={given}")
