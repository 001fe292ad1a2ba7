"""The best eval so far, and early stopping (--best_metric,
--best_mode, --early_stopping_patience).

Every worker decides from the same reduced eval metrics, so every worker
takes the same decision without a message: whether to keep this step's
checkpoint as the best, and whether to stop. A sidecar evaluator decides
alone: it writes its stop into best.json, and `SidecarStop` reads it on
the chief at each checkpoint.
"""

import dataclasses
import math

from absl import logging
import keras
import tensorflow as tf

from tfdist.errors import ConfigError

BEST_EXPORT_DIR = "best_export"


@dataclasses.dataclass(frozen=True)
class Decision:
  improved: bool
  stop: bool


class BestTracker:
  """Follows one eval metric across evals, and across resumes: its state
  is three variables, written to model_dir/best_checkpoint/best.json with
  each change and read back (then sent from the chief to every worker,
  with the restored checkpoint)."""

  def __init__(self, *, metric, mode, patience=0, metric_names=()):
    if metric_names and metric not in metric_names:
      raise ConfigError(f"--best_metric must be an eval metric of this "
                        f"task ({', '.join(metric_names)}). Received: "
                        f"best_metric={metric!r}")
    if mode not in ("min", "max"):
      raise ConfigError(f"--best_mode must be min or max (or auto). "
                        f"Received: best_mode={mode!r}")
    if patience < 0:
      raise ConfigError(f"--early_stopping_patience must be >= 0. Received: "
                        f"early_stopping_patience={patience}")
    self.metric = metric
    self.mode = mode
    self.patience = patience
    # Local to this worker (outside any strategy scope). NaN: no eval yet.
    self.best_value = tf.Variable(math.nan, dtype=tf.float64,
                                  trainable=False, name="best_value")
    self.best_step = tf.Variable(-1, dtype=tf.int64, trainable=False,
                                 name="best_step")
    self.evals_without_improvement = tf.Variable(
        0, dtype=tf.int64, trainable=False, name="evals_without_improvement")
    # The step whose eval stopped the run; -1: none.
    self.stopped_step = tf.Variable(-1, dtype=tf.int64, trainable=False,
                                    name="early_stopped_step")
    # The best step whose export is not written yet (a preemption left it
    # to the resume, or a kill cut it short); -1: none.
    self.export_pending_step = tf.Variable(
        -1, dtype=tf.int64, trainable=False, name="export_pending_step")

  @property
  def variables(self):
    return [self.best_value, self.best_step, self.evals_without_improvement,
            self.stopped_step, self.export_pending_step]

  def state(self):
    return {"metric": self.metric, "mode": self.mode,
            "value": float(self.best_value.numpy()),
            "step": int(self.best_step.numpy()),
            "evals_without_improvement": int(
                self.evals_without_improvement.numpy()),
            "early_stopped_at_step": self.stopped_at,
            "export_pending_at_step": self.export_pending_at}

  @property
  def stopped_at(self):
    """The step whose eval stopped the run, or None."""
    return _step_or_none(self.stopped_step)

  @property
  def export_pending_at(self):
    """The best step whose export is still to be written, or None."""
    return _step_or_none(self.export_pending_step)

  def load(self, state):
    """Takes a state() written by an earlier run on the same metric."""
    if not state or state.get("metric") != self.metric or (
        state.get("mode") != self.mode):
      return
    self.best_value.assign(state["value"])
    self.best_step.assign(state["step"])
    self.evals_without_improvement.assign(state["evals_without_improvement"])
    for variable, key in ((self.stopped_step, "early_stopped_at_step"),
                          (self.export_pending_step,
                           "export_pending_at_step")):
      variable.assign(-1 if state.get(key) is None else state[key])

  def stopped_at_step(self, step):
    """Whether the eval of `step` stopped the run: restored, an early stop
    decided in the eval a preemption interrupted (its checkpoint is of
    that step), and still decided under this run's patience. Read from
    variables every worker holds alike."""
    return bool(self.patience) and (
        int(self.stopped_step.numpy()) == step) and (
            int(self.evals_without_improvement.numpy()) >= self.patience)

  def _better(self, value):
    if math.isnan(value):
      return False
    best = float(self.best_value.numpy())
    if math.isnan(best):
      return True
    return value < best if self.mode == "min" else value > best

  def update(self, step, metrics) -> Decision:
    value = float(metrics[self.metric])
    improved = self._better(value)
    if improved:
      self.best_value.assign(value)
      self.best_step.assign(step)
      self.evals_without_improvement.assign(0)
    else:
      self.evals_without_improvement.assign_add(1)
    stop = bool(self.patience) and (
        int(self.evals_without_improvement.numpy()) >= self.patience)
    if stop:
      self.stopped_step.assign(step)
    return Decision(improved=improved, stop=stop)


def _step_or_none(variable):
  step = int(variable.numpy())
  return None if step < 0 else step


class SidecarStop(keras.callbacks.Callback):
  """On the chief of a run whose evals a sidecar evaluator makes: at each
  checkpoint step, stops the run (after that checkpoint; tfdist.callbacks
  sends the stop to every worker) once best.json says the sidecar's early
  stopping fired on a checkpoint this run wrote."""

  def __init__(self, *, read_state, metric, checkpoint_every, global_step):
    super().__init__()
    self._read_state = read_state
    self._metric = metric
    self._every = checkpoint_every
    self._global_step = global_step
    self._start_step = 0

  def on_train_begin(self, logs=None):
    # A stop recorded at or before the restored step is an earlier run's.
    self._start_step = int(self._global_step.numpy())

  def on_train_batch_end(self, batch, logs=None):
    step = batch  # tfdist passes the global step.
    if not self._every or step % self._every or self.model.stop_training:
      return
    state = self._read_state() or {}
    stopped_at = state.get("early_stopped_at_step")
    if (state.get("metric") == self._metric and stopped_at is not None
        and stopped_at > self._start_step):
      logging.info(
          "The sidecar evaluator stopped early at step %d (best %s %.4f at "
          "step %d); stopping after the checkpoint at step %d.", stopped_at,
          self._metric, state["value"], state["step"], step)
      self.model.stop_training = True
