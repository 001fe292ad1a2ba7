"""One launch.sweep trial, as run by Ray Tune: a full tfdist run in a
subprocess, whose eval metrics are followed in its --metrics_file and
reported to Tune as they come, so that ASHA can stop a weak trial early.

Only the standard library, ray and launch.ray_actor's child set-up: Tune
ships this module to its workers by value, so the nodes need no copy of
the launcher's checkout.
"""

import json
import os
import subprocess
import sys
import time

from ray import cloudpickle
from ray import tune

# A function, not the module: it travels by value with this one (Tune's
# workers need not import the launcher's package).
from .ray_actor import child_preparer

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def flag_args(values):
  """{name: value} as tfdist.train flags."""
  args = []
  for name, value in sorted(values.items()):
    if isinstance(value, bool):
      args.append(f"--{name}" if value else f"--no{name}")
    elif isinstance(value, (list, tuple)):
      args.append(f"--{name}={','.join(str(v) for v in value)}")
    else:
      args.append(f"--{name}={value}")
  return args


def trial_command(params, *, fixed, model_dir, metrics_file, workers):
  """The trial's command: tfdist.train, or launch.local for several
  workers (multi-worker mirrored on the trial's node)."""
  train = [*flag_args({**fixed, **params}), f"--model_dir={model_dir}",
           f"--metrics_file={metrics_file}"]
  if workers <= 1:
    return [sys.executable, "-m", "tfdist.train", *train]
  return [sys.executable, "-m", "tfdist.launch.local", f"--workers={workers}",
          "--", "--strategy=multi_worker_mirrored", *train]


class _Follower:
  """Reads the whole lines appended to a JSON-lines file since the start."""

  def __init__(self, path):
    self._path = path
    # A resumed trial's earlier lines were reported before the interruption.
    self._offset = os.path.getsize(path) if os.path.exists(path) else 0
    self._partial = ""

  def new_records(self):
    if not os.path.exists(self._path):
      return []
    with open(self._path, encoding="utf-8") as f:
      f.seek(self._offset)
      text = f.read()
      self._offset = f.tell()
    lines = (self._partial + text).split("\n")
    self._partial = lines.pop()
    return [json.loads(line) for line in lines if line.strip()]


def run_trial(params, *, fixed, trials_dir, workers, cwd, poll_seconds=0.5):
  """The Tune function trainable (bound with tune.with_parameters)."""
  context = tune.get_context()
  model_dir = os.path.join(trials_dir, context.get_trial_id())
  os.makedirs(model_dir, exist_ok=True)
  metrics_file = os.path.join(model_dir, "metrics.jsonl")
  log_path = os.path.join(model_dir, "trial.log")
  follower = _Follower(metrics_file)
  command = trial_command(params, fixed=fixed, model_dir=model_dir,
                          metrics_file=metrics_file, workers=workers)
  with open(log_path, "ab") as log:
    process = subprocess.Popen(
        command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, preexec_fn=child_preparer(),
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
      while True:
        done = process.poll() is not None
        for record in follower.new_records():
          tune.report({**record, "model_dir": model_dir})
        if done:
          break
        time.sleep(poll_seconds)
    finally:
      # Stopped by the scheduler (or failed): the run must not go on.
      # SIGTERM first, so that a launch.local of a multi-worker trial
      # stops its tasks and removes its network namespace.
      if process.poll() is None:
        process.terminate()
        try:
          process.wait(timeout=20)
        except subprocess.TimeoutExpired:
          process.kill()
          process.wait()
  if process.returncode != 0:
    with open(log_path, encoding="utf-8", errors="replace") as f:
      tail = f.read()[-1500:]
    raise RuntimeError(f"the tfdist run exited with code "
                       f"{process.returncode}; the end of {log_path}:\n{tail}")
