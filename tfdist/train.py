"""Trains a model with tfdist, on any tf.distribute strategy.

  python -m tfdist.train --model_dir=DIR [--model=mlp --dataset=digits
      --strategy=auto --train_steps=300 ...]

Rerun the same command to resume from the last checkpoint in DIR. The main
flags are below; --helpfull lists every flag, by section, and
docs/flags.md explains them.
"""

# python -m tfdist.train is the CLI, the only module that reads FLAGS. It
# is also the Python API: `tfdist.train(task_or_config, **options)` calls
# this module, which forwards to tfdist.api.train. Flags are defined only
# when the CLI runs, so importing tfdist defines no absl flags in a user's
# process.

import os
import signal
import sys
import types

from absl import app
from absl import flags
from absl import logging

from tfdist import errors
from tfdist import cluster
from tfdist import config as config_lib
from tfdist import options as options_lib
from tfdist.errors import PEER_LOST_EXIT_CODE
from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.errors import TfdistError

FLAGS = flags.FLAGS


def _default_text(option):
  if option.kind == "ints":
    return [str(v) for v in option.default or ()]
  return option.default


def define_flags(flag_values=FLAGS):
  """One absl flag per option, grouped by section for --helpfull."""
  for option in options_lib.OPTIONS:
    kwargs = dict(flag_values=flag_values,
                  module_name=f"tfdist {option.section}")
    default = _default_text(option)
    if option.kind == "enum":
      flags.DEFINE_enum(option.name, default, option.choices, option.help,
                        **kwargs)
    elif option.kind == "ints":
      flags.DEFINE_list(option.name, default, option.help, **kwargs)
    else:
      define = {"str": flags.DEFINE_string, "int": flags.DEFINE_integer,
                "float": flags.DEFINE_float,
                "bool": flags.DEFINE_boolean}[option.kind]
      define(option.name, default, option.help, **kwargs)


def _flag_value(option, flag_values):
  value = flag_values[option.name].value
  if option.kind != "ints":
    return value
  try:
    numbers = tuple(int(v) for v in value)
  except ValueError:
    raise TfdistError(f"--{option.name} takes integers. Received: "
                      f"{option.name}={','.join(value)}") from None
  return numbers or option.default


def config_from_flags(flag_values=FLAGS):
  """Turns the flags into a frozen, validated Config."""
  return config_lib.Config(**{o.name: _flag_value(o, flag_values)
                              for o in options_lib.OPTIONS})


def _fail(message, exit_code=2):
  sys.stderr.write(f"tfdist: error: {message}\n")
  sys.exit(exit_code)


def _parse_flags(argv):
  try:
    return FLAGS(argv)
  except flags.Error as e:
    _fail(str(e).splitlines()[0].removeprefix("ERROR:: "))


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OUR_PACKAGES = tuple(os.path.join(_ROOT, name, "")
                      for name in ("tfdist", "models", "launch", "tools"))


def _ours_or_warning(record):
  """Hides other libraries' INFO chatter (tfds, tf.distribute) by default."""
  return (record.levelno >= logging.converter.STANDARD_WARNING or
          record.pathname.startswith(_OUR_PACKAGES))


def _setup_logging(verbose):
  handler = logging.get_absl_handler().python_handler
  handler.setFormatter(_ShortFormatter())
  if not verbose:
    handler.addFilter(_ours_or_warning)


class _ShortFormatter(logging.PythonFormatter):
  def format(self, record):
    stamp = self.formatTime(record, "%H:%M:%S")
    level = "" if record.levelname == "INFO" else record.levelname + ": "
    return f"{stamp} {level}{record.getMessage()}"


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}")
  show_native = FLAGS.native_logs or FLAGS.verbosity >= 1
  _setup_logging(verbose=show_native)
  # The one environment write: quiet TF's runtime logs unless asked not to.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if show_native else "2")
  try:
    config = config_from_flags()
    from tfdist import api  # pylint: disable=g-import-not-at-top
    result = api.run(config, tf_config=_cluster(config),
                     show_native_logs=show_native)
  except TfdistError as e:
    if e.exit_code in (PEER_LOST_EXIT_CODE, PREEMPTED_EXIT_CODE):
      errors.exit_at_once(str(e), e.exit_code)
    _fail(str(e), e.exit_code)
  except KeyboardInterrupt:
    # Ctrl-C: the last checkpoint stays the newest; say so, not a traceback.
    _fail("interrupted (SIGINT); rerun the same command to resume from the "
          "last checkpoint.", 128 + signal.SIGINT)
  if result is None:  # A serving task (ps, PS worker) or the evaluator.
    return
  for line in api.summary_lines(config, result):
    print(line, flush=True)


def _cluster(config):
  if config.cluster == "slurm":
    return cluster.tf_config_from_slurm(
        os.environ, ps_tasks=config.ps_tasks, base_port=config.cluster_port)
  return cluster.tf_config_from_env(os.environ)


def _show_key_flags_in_help(flag_values=FLAGS):
  """absl's --help lists the main module's key flags: make the main flags
  of each section key flags of whatever module runs (this one, or the
  tfdist-train script), and give the script this usage text."""
  for name in options_lib.KEY_OPTIONS:
    flag_values.register_key_flag_for_module(sys.argv[0], flag_values[name])
  main_module = sys.modules["__main__"]
  if not main_module.__doc__:
    main_module.__doc__ = __doc__


def run_cli():
  """The console script and `python -m tfdist.train`."""
  if "model_dir" not in FLAGS:
    define_flags()
    _show_key_flags_in_help()
  app.run(main, flags_parser=_parse_flags)


class _CallableModule(types.ModuleType):
  """Lets `tfdist.train(...)` be the Python API while `python -m
  tfdist.train` stays the CLI."""

  def __call__(self, task_or_config=None, **options):
    from tfdist import api  # pylint: disable=g-import-not-at-top
    return api.train(task_or_config, **options)


sys.modules[__name__].__class__ = _CallableModule


if __name__ == "__main__":
  run_cli()
