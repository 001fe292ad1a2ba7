"""Hyperparameter sweeps over Ray Tune: each trial is a full tfdist run.

python -m launch.sweep --space=configs/sweep_digits.yaml [--trials=4]
    [--max_concurrent=2] [--metric=accuracy] [--mode=max]
    [--sweep_dir=runs/sweeps] [--name=NAME] [--workers_per_trial=1]
    [--address=auto] [-- <extra tfdist.train flags>]

The YAML file has `flags` (fixed tfdist.train flags of every trial) and
`space` (sampled ones), each sampled value written as one of
  {choice: [a, b, ...]}, {uniform: [low, high]}, {loguniform: [low, high]}.
Names and values are checked against tfdist's own options before Ray
starts.

Each trial runs in its own model_dir, sweep_dir/NAME/trials/TRIAL_ID, with
its resources reserved through a placement group (one bundle per worker).
The chief appends its eval metrics to --metrics_file; the trial follows
that file and reports each eval to Tune, where ASHA (time attribute: the
training step) stops weak trials early. At the end a table ranks the
trials by their best eval metric. TensorBoard pointed at the sweep
directory shows every trial in the HParams dashboard.

Run the same command again after an interruption: finished trials are
kept, and unfinished ones resume from their checkpoints.
"""

import argparse
import logging
import os
import signal
import sys
import time

import yaml

from . import processes
from . import ray_session
from tfdist import options as options_lib

try:
  from ray import tune
  from ray.tune.schedulers import ASHAScheduler
  from ray.tune.search.basic_variant import BasicVariantGenerator
  from . import sweep_trial
except ImportError:  # The `ray` extra is not installed; main() says so.
  tune = None

DISTRIBUTIONS = ("choice", "uniform", "loguniform")
# Set by the sweep for each trial, never by the space.
_RESERVED = ("model_dir", "metrics_file")


class SpaceError(ValueError):
  """A search space file that cannot be used."""


def _check_value(name, value, where):
  message = options_lib.BY_NAME[name].check(value)
  if message:
    raise SpaceError(f"{where}: {message}")


def load_space(path):
  """Reads and checks a space file; returns (fixed flags, space spec)."""
  try:
    with open(path, encoding="utf-8") as f:
      document = yaml.safe_load(f)
  except OSError as e:
    raise SpaceError(f"cannot read {path}: {e.strerror}") from None
  except yaml.YAMLError as e:
    raise SpaceError(f"{path} is not valid YAML: {e}") from None
  if not isinstance(document, dict) or set(document) - {"flags", "space"}:
    raise SpaceError(f"{path} must be a mapping with `flags` and `space`. "
                     f"Received: {document!r:.200}")
  fixed = document.get("flags") or {}
  space = document.get("space") or {}
  if not isinstance(fixed, dict) or not isinstance(space, dict) or not space:
    raise SpaceError(f"{path}: `flags` must be a mapping and `space` a "
                     "non-empty mapping of flag names to distributions.")
  for name, value in {**fixed, **space}.items():
    if name not in options_lib.BY_NAME:
      raise SpaceError(f"{path}: unknown tfdist flag {name!r}.")
    if name in _RESERVED:
      raise SpaceError(f"{path}: {name} is set by the sweep for each trial.")
  for name, value in fixed.items():
    _check_value(name, value, f"{path}: flags.{name}")
  for name, spec in space.items():
    where = f"{path}: space.{name}"
    if not isinstance(spec, dict) or len(spec) != 1 or \
        next(iter(spec)) not in DISTRIBUTIONS:
      raise SpaceError(f"{where} must be one of "
                       f"{', '.join('{%s: [...]}' % d for d in DISTRIBUTIONS)}"
                       f". Received: {spec!r}")
    (kind, values), = spec.items()
    if kind == "choice":
      if not isinstance(values, list) or not values:
        raise SpaceError(f"{where}: choice needs a non-empty list. "
                         f"Received: {values!r}")
      for value in values:
        _check_value(name, value, where)
      continue
    if (not isinstance(values, list) or len(values) != 2 or
        not all(isinstance(v, (int, float)) for v in values) or
        not values[0] < values[1]):
      raise SpaceError(f"{where}: {kind} needs [low, high] with low < high. "
                       f"Received: {values!r}")
    if kind == "loguniform" and values[0] <= 0:
      raise SpaceError(f"{where}: loguniform needs low > 0. Received: "
                       f"{values!r}")
    for value in values:
      _check_value(name, float(value), where)
  return fixed, space


def tune_space(space):
  """The space spec as Ray Tune search-space objects."""
  make = {"choice": tune.choice,
          "uniform": lambda v: tune.uniform(*v),
          "loguniform": lambda v: tune.loguniform(*v)}
  return {name: make[kind](values)
          for name, spec in space.items() for kind, values in spec.items()}


def parse_args(argv):
  parser = argparse.ArgumentParser(
      prog="python -m launch.sweep",
      description="A hyperparameter sweep of tfdist runs over Ray Tune.")
  parser.add_argument("--space", required=True,
                      help="YAML file with `flags` and `space`.")
  parser.add_argument("--trials", type=int, default=4,
                      help="Number of sampled trials.")
  parser.add_argument("--max_concurrent", type=int, default=2,
                      help="Trials running at once.")
  parser.add_argument("--metric", default="accuracy",
                      help="Eval metric that ranks and stops trials.")
  parser.add_argument("--mode", choices=("max", "min"), default="max")
  parser.add_argument("--sweep_dir", default="runs/sweeps",
                      help="Where sweeps (and every trial's model_dir) go.")
  parser.add_argument("--name", default=None,
                      help="Sweep name (default: the space file's name). "
                      "An existing sweep of that name resumes.")
  parser.add_argument("--workers_per_trial", type=int, default=1,
                      help="Workers per trial (multi-worker mirrored).")
  parser.add_argument("--grace_steps", type=int, default=None,
                      help="ASHA: steps before a trial may be stopped "
                      "(default: the space's eval_every).")
  parser.add_argument("--reduction_factor", type=float, default=2.0,
                      help="ASHA: keep the best 1/this at each rung.")
  parser.add_argument("--address", default=None,
                      help="Ray cluster to join; default: a local Ray.")
  parser.add_argument("--seed", type=int, default=None,
                      help="Seed of the sampling, for a repeatable sweep.")
  parser.add_argument("train_args", nargs=argparse.REMAINDER,
                      help="-- then extra tfdist.train flags.")
  args = parser.parse_args(argv)
  if args.train_args[:1] == ["--"]:
    args.train_args = args.train_args[1:]
  for name in ("trials", "max_concurrent", "workers_per_trial"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1. Received: {getattr(args, name)}")
  try:
    args.fixed, args.space_spec = load_space(args.space)
  except SpaceError as e:
    parser.error(str(e))
  args.fixed = {**args.fixed, **_flags_as_dict(parser, args.train_args)}
  args.name = args.name or os.path.splitext(os.path.basename(args.space))[0]
  args.train_steps = args.fixed.get(
      "train_steps", options_lib.BY_NAME["train_steps"].default)
  args.eval_every = args.fixed.get(
      "eval_every", options_lib.BY_NAME["eval_every"].default)
  if not args.eval_every:
    parser.error("trials report at each eval: set eval_every > 0 in the "
                 "space's flags")
  args.grace_steps = args.grace_steps or args.eval_every
  return args


_PARSERS = {"int": int, "float": float,
            "bool": lambda v: {"true": True, "false": False}[v.lower()],
            "ints": lambda v: [int(x) for x in v.split(",")]}


def _flags_as_dict(parser, train_args):
  """Extra `--name=value` flags after --, typed and checked as tfdist's
  options; they override the space file's `flags`."""
  extra = {}
  for arg in train_args:
    name, has_value, text = arg[2:].partition("=")
    if not arg.startswith("--") or not has_value:
      parser.error(f"extra train flags must be --name=value. Received: {arg}")
    option = options_lib.BY_NAME.get(name)
    if option is None or name in _RESERVED:
      parser.error(f"unknown or reserved tfdist flag after --: {arg}")
    try:
      value = _PARSERS.get(option.kind, str)(text)
    except (ValueError, KeyError):
      parser.error(f"--{name} takes a {option.kind}. Received: {arg}")
    message = option.check(value)
    if message:
      parser.error(message)
    extra[name] = value
  return extra


def _shown(value):
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def ranked_rows(results, *, metric, mode, params):
  """[(trial, params, best metric, its step, last step, model_dir)], best
  first; trials that reported nothing come last."""
  rows = []
  for result in results:
    frame = result.metrics_dataframe
    trial_id = (result.metrics or {}).get("trial_id", "?")
    if frame is None or metric not in frame or frame[metric].dropna().empty:
      rows.append((trial_id, result.config or {}, None, None, None,
                   (result.metrics or {}).get("model_dir", "")))
      continue
    frame = frame.dropna(subset=[metric])
    best = frame[metric].idxmax() if mode == "max" else frame[metric].idxmin()
    rows.append((trial_id, {p: result.config.get(p) for p in params},
                 float(frame[metric][best]), int(frame["step"][best]),
                 int(frame["step"].max()), frame["model_dir"].iloc[-1]))
  sign = -1 if mode == "max" else 1
  return sorted(rows, key=lambda r: (r[2] is None,
                                     sign * (r[2] or 0.0)))


def format_table(rows, *, metric, params, train_steps):
  header = ["rank", "trial", *params, f"best {metric}", "at step",
            "ran to", "model_dir"]
  lines = [header]
  for rank, (trial, config, best, step, last, model_dir) in enumerate(
      rows, 1):
    ran = ("-" if last is None else
           f"{last}" + ("" if last >= train_steps else " (stopped)"))
    lines.append([str(rank), trial, *(_shown(config.get(p)) for p in params),
                  "-" if best is None else f"{best:.4f}",
                  "-" if step is None else str(step), ran, model_dir])
  widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
  return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths))
                   .rstrip() for line in lines)


class _Progress(tune.Callback if tune else object):
  """One line per eval of a trial, and one when a trial ends."""

  def __init__(self, metric, log, train_steps):
    self._metric = metric
    self._log = log
    self._train_steps = train_steps
    self._steps = {}

  def on_trial_start(self, iteration, trials, trial, **info):
    shown = ", ".join(f"{k}={_shown(v)}" for k, v in sorted(
        trial.config.items()))
    self._log(f"{trial.trial_id} started: {shown}")

  def on_trial_result(self, iteration, trials, trial, result, **info):
    value = result.get(self._metric)
    shown = "?" if value is None else f"{value:.4f}"
    self._steps[trial.trial_id] = result.get("step", 0)
    self._log(f"{trial.trial_id} step {result.get('step')}: "
              f"{self._metric} {shown}")

  def on_trial_complete(self, iteration, trials, trial, **info):
    step = self._steps.get(trial.trial_id, 0)
    self._log(f"{trial.trial_id} finished" if step >= self._train_steps else
              f"{trial.trial_id} stopped early by ASHA at step {step}")

  def on_trial_error(self, iteration, trials, trial, **info):
    self._log(f"{trial.trial_id} failed; see {trial.error_file or 'its log'}")


def _tuner(args, log):
  experiment = os.path.join(os.path.abspath(args.sweep_dir), args.name)
  trials_dir = os.path.join(experiment, "trials")
  trainable = tune.with_resources(
      tune.with_parameters(sweep_trial.run_trial, fixed=args.fixed,
                           trials_dir=trials_dir,
                           workers=args.workers_per_trial, cwd=os.getcwd()),
      tune.PlacementGroupFactory([{"CPU": 1}] * args.workers_per_trial))
  if tune.Tuner.can_restore(experiment):
    log(f"resuming the sweep in {experiment}: finished trials are kept, "
        "unfinished ones resume from their checkpoints")
    return tune.Tuner.restore(experiment, trainable=trainable,
                              resume_unfinished=True, resume_errored=True)
  searcher = BasicVariantGenerator(random_state=args.seed,
                                   max_concurrent=args.max_concurrent)
  scheduler = ASHAScheduler(
      time_attr="step", max_t=args.train_steps, grace_period=args.grace_steps,
      reduction_factor=args.reduction_factor)
  return tune.Tuner(
      trainable, param_space=tune_space(args.space_spec),
      tune_config=tune.TuneConfig(
          metric=args.metric, mode=args.mode, scheduler=scheduler,
          search_alg=searcher, num_samples=args.trials),
      run_config=tune.RunConfig(
          name=args.name, storage_path=os.path.abspath(args.sweep_dir),
          verbose=0, callbacks=[_Progress(args.metric, log, args.train_steps)]))


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)

  def log(message):
    processes.write_line(sys.stdout, f"[sweep] {message}")

  started = time.monotonic()
  # Tune's own progress tables: our [sweep] lines say the same, shorter.
  os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
  # Tune warns about every trial that has not reported yet when a sweep is
  # interrupted; the table shows those trials anyway.
  logging.getLogger("ray.tune").setLevel(logging.ERROR)
  try:
    with ray_session.session(address=args.address, log=log,
                            cpus_needed=args.max_concurrent *
                            args.workers_per_trial):
      code = _sweep(args, log, started)
  except ray_session.RayUnavailable as e:
    sys.exit(f"python -m launch.sweep: error: {e}")
  sys.exit(code)


def _sweep(args, log, started):
  """Runs (or resumes) the sweep, prints the table; returns the exit
  code: 130 if interrupted, 1 if every trial failed."""
  results = _tuner(args, log).fit()
  params = sorted(args.space_spec)
  rows = ranked_rows(results, metric=args.metric, mode=args.mode,
                     params=params)
  print(format_table(rows, metric=args.metric, params=params,
                     train_steps=args.train_steps), flush=True)
  # The saved state is what a rerun resumes from: count from it.
  saved = [t.status for t in tune.ExperimentAnalysis(
      os.path.join(os.path.abspath(args.sweep_dir), args.name)).trials]
  failed = saved.count("ERROR")
  unfinished = args.trials - saved.count("TERMINATED") - failed
  log(f"{len(rows)} trials in {time.monotonic() - started:.0f}s "
      f"({failed} failed); TensorBoard with every trial's hparams: "
      f"tensorboard --logdir {os.path.join(args.sweep_dir, args.name)}")
  if unfinished:
    log(f"interrupted with {unfinished} trial(s) unfinished; run the same "
        "command again to resume.")
    return 128 + signal.SIGINT
  return 1 if failed == len(rows) else 0


if __name__ == "__main__":
  main()
