"""TensorBoard output: scalars for train/eval, HParams, profiler traces;
and eval metrics as JSON lines for programs that follow a run (sweeps)."""

import json

from absl import logging
import tensorflow as tf
from tensorboard.plugins.hparams import api as hparams_api

from tfdist import storage


def _hparam_value(value):
  if isinstance(value, (bool, int, float, str)):
    return value
  return str(value)


class Summaries:
  """Event files in model_dir/train and model_dir/eval (chief only)."""

  def __init__(self, model_dir, *, enabled=True, metrics_file=None):
    self._enabled = enabled
    self._metrics_file = metrics_file if enabled else None
    self._dirs = {kind: storage.join(model_dir, kind)
                  for kind in ("train", "eval")}
    self._writers = {}
    self._profiling = False

  def _writer(self, kind):
    if kind not in self._writers:
      self._writers[kind] = (
          tf.summary.create_file_writer(self._dirs[kind]) if self._enabled
          else tf.summary.create_noop_writer())
    return self._writers[kind]

  def scalars(self, kind, step, values):
    with self._writer(kind).as_default(step=step):
      for name, value in values.items():
        tf.summary.scalar(name, value)
    if kind == "eval" and self._metrics_file:
      # One whole line per write, flushed at once: a follower never reads
      # half a record.
      line = json.dumps({"step": int(step),
                         **{k: float(v) for k, v in values.items()}})
      with tf.io.gfile.GFile(self._metrics_file, "a") as f:
        f.write(line + "\n")

  def hparams(self, config_dict):
    with self._writer("train").as_default():
      hparams_api.hparams({k: _hparam_value(v) for k, v in config_dict.items()
                           if v is not None})

  def start_profile(self):
    if self._enabled and not self._profiling:
      tf.profiler.experimental.start(self._dirs["train"])
      self._profiling = True
      logging.info("Profiler started.")

  def stop_profile(self):
    if self._profiling:
      tf.profiler.experimental.stop()
      self._profiling = False
      logging.info("Profiler trace written under %s/plugins/profile.",
                   self._dirs["train"])

  def close(self):
    self.stop_profile()
    for writer in self._writers.values():
      writer.flush()
      writer.close()
