"""Keras callbacks at tfdist's own boundaries, and the decisions they take
made the same on every worker.

The Trainer is handed one `Callbacks` (or None) and calls it:
- `train_begin(step)` after the restore;
- `call_end(step, logs)` after each loop call, with that call's train
  metrics (Keras's `on_train_batch_end`, one "batch" per call);
- `eval_end(step, eval_logs, train_logs)` after each eval (Keras's
  `on_epoch_end`: `val_<metric>` and the train metrics; epochs are the
  intervals between evals);
- `train_end(logs)` at the end.
The callbacks themselves run on the chief only (they may write files).
What they decide, `model.stop_training` and the optimizer's learning
rate, is then sent from the chief to every worker (`sync`), so that no
worker trains on or stops alone.
"""

import keras
import numpy as np
import tensorflow as tf

from tfdist import replica_check
from tfdist.errors import ConfigError

# Keras callbacks that cannot work here, and why.
_REFUSED = {
    "BackupAndRestore": "tfdist checkpoints and resumes by itself "
                        "(--checkpoint_every)",
    "ModelCheckpoint": "tfdist checkpoints by itself; --best_metric keeps "
                       "the best checkpoint",
    "TensorBoard": "tfdist writes TensorBoard events to model_dir by itself",
    "ProgbarLogger": "tfdist prints its own progress lines",
}


class _CallbackModel:
  """What a callback sees as `self.model`: the model, with the
  `optimizer` and `stop_training` a compiled Keras model has."""

  def __init__(self, model, optimizer):
    object.__setattr__(self, "_model", model)
    object.__setattr__(self, "optimizer", optimizer)
    object.__setattr__(self, "stop_training", False)

  def __getattr__(self, name):
    return getattr(self._model, name)

  def __setattr__(self, name, value):
    if name in ("stop_training", "optimizer"):
      object.__setattr__(self, name, value)
    else:
      setattr(self._model, name, value)


def check(callbacks):
  """The callbacks as a list; ConfigError names one that cannot work."""
  callbacks = list(callbacks or ())
  for callback in callbacks:
    if not isinstance(callback, keras.callbacks.Callback):
      raise ConfigError(f"callbacks must be keras.callbacks.Callback "
                        f"objects. Received: a {type(callback).__name__}")
    why = _REFUSED.get(type(callback).__name__)
    if why:
      raise ConfigError(f"keras.callbacks.{type(callback).__name__} cannot "
                        f"run under tfdist: {why}.")
  return callbacks


def check_sharded_weights(callbacks):
  """--shard=params: a callback that keeps the model's weights
  (get_weights) cannot read sharded ones."""
  keeps = [type(c).__name__ for c in callbacks
           if getattr(c, "restore_best_weights", False)]
  if keeps:
    raise ConfigError(
        f"--shard=params: {', '.join(keeps)}(restore_best_weights=True) "
        "keeps the model's whole weights, which no replica holds; use "
        "--best_metric (the best checkpoint) instead.")


def rate_variable(optimizer):
  """The optimizer's learning rate when it is a variable (a constant
  rate), else None (a schedule: a callback cannot set it)."""
  optimizer = getattr(optimizer, "inner_optimizer", optimizer)
  rate = getattr(optimizer, "_learning_rate", None)
  return rate if isinstance(rate, (tf.Variable, keras.Variable)) else None


class Callbacks:
  """Keras callbacks called at tfdist's boundaries.

  `sync`: None in one process (or on a PS coordinator); else a function
  that takes this worker's (stop, learning rate) and returns the chief's,
  a collective that every worker calls at the same points.
  """

  def __init__(self, callbacks, *, model, optimizer, is_chief, train_steps,
               eval_every=0, sync=None):
    self._model = _CallbackModel(model, optimizer)
    self._optimizer = optimizer
    self._sync = sync
    self._list = keras.callbacks.CallbackList(
        check(callbacks) if is_chief else [], model=self._model,
        add_history=False, add_progbar=False, steps=train_steps, epochs=None,
        verbose=0)
    self._eval_every = eval_every
    self._epoch = 0

  @property
  def stop_training(self):
    return bool(self._model.stop_training)

  def train_begin(self, step):
    # Epochs are the intervals between evals: a resumed run is in the one
    # its step says (LearningRateScheduler's rate depends on it).
    self._epoch = step // self._eval_every if self._eval_every else 0
    self._list.on_train_begin()
    self._list.on_epoch_begin(self._epoch)
    # LearningRateScheduler sets the rate in on_epoch_begin.
    self._agree()

  def call_end(self, step, logs):
    self._list.on_train_batch_end(step, _floats(logs))
    self._agree()

  def eval_end(self, step, eval_logs, train_logs):
    del step
    logs = {**_floats(train_logs),
            **{f"val_{k}": v for k, v in _floats(eval_logs).items()
               if k != "examples"}}
    self._list.on_epoch_end(self._epoch, logs)
    self._epoch += 1
    # The chief's next epoch begins before the one agreement, so that a
    # rate set in on_epoch_begin reaches every worker with the stop.
    if not self.stop_training:
      self._list.on_epoch_begin(self._epoch)
    self._agree()

  def train_end(self, logs):
    self._list.on_train_end(_floats(logs))

  def _agree(self):
    """The chief's stop and learning rate, on every worker."""
    if self._sync is None:
      return
    rate = rate_variable(self._optimizer)
    stop, value = self._sync(
        float(self.stop_training),
        float(np.asarray(rate)) if rate is not None else 0.0)
    self._model.stop_training = bool(stop)
    if rate is not None:
      rate.assign(value)


def _floats(logs):
  return {k: float(v) for k, v in (logs or {}).items()
          if isinstance(v, (int, float, np.floating, np.integer))}


def chief_values(strategy):
  """A `sync` for Callbacks: a collective that returns replica 0's
  (stop, learning rate) on every worker."""

  @tf.function
  def from_chief(stop, rate):
    return replica_check.from_replica_zero(strategy, tf.stack([stop, rate]))

  def sync(stop, rate):
    values = from_chief(tf.constant(stop, tf.float32),
                        tf.constant(rate, tf.float32)).numpy()
    return values[0] > 0, float(values[1])
  return sync
