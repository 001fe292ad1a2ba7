"""Optimizers and learning-rate schedules by name (Keras 3)."""

import math

from tfdist.errors import ConfigError

# The one table of optimizers: name -> (Keras class name, fixed arguments).
_OPTIMIZERS = {
    "sgd": ("SGD", {}),
    "momentum": ("SGD", {"momentum": 0.9}),
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "rmsprop": ("RMSprop", {}),
}
NAMES = tuple(_OPTIMIZERS)


def scheduled_rate(step, *, schedule, learning_rate, warmup_steps,
                   decay_steps, end_learning_rate):
  """The learning rate at `step`, as a pure function of floats.

  A linear warmup from 0 to `learning_rate` over `warmup_steps`, then the
  schedule over `decay_steps`, then constant.
  """
  if warmup_steps and step < warmup_steps:
    return learning_rate * step / warmup_steps
  since = step - warmup_steps
  if schedule == "constant" or not decay_steps:
    return learning_rate
  if schedule == "step":
    return learning_rate * 0.1 ** (since // decay_steps)
  progress = min(since, decay_steps) / decay_steps
  if schedule == "linear":
    return learning_rate + (end_learning_rate - learning_rate) * progress
  if schedule == "cosine":
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return end_learning_rate + (learning_rate - end_learning_rate) * cosine
  raise ConfigError(f"Unrecognized lr_schedule: {schedule!r}")


def schedule_kwargs(config):
  """The schedule's arguments from a Config (decay_steps 0: to the end)."""
  return dict(schedule=config.lr_schedule,
              learning_rate=config.learning_rate,
              warmup_steps=config.warmup_steps,
              decay_steps=config.decay_steps or max(
                  config.train_steps - config.warmup_steps, 1),
              end_learning_rate=config.end_learning_rate)


def _keras_schedule(kwargs):
  """The same schedule as a Keras LearningRateSchedule, in TF ops."""
  import keras
  import tensorflow as tf

  class Schedule(keras.optimizers.schedules.LearningRateSchedule):

    def __call__(self, step):
      step = tf.cast(step, tf.float32)
      peak = kwargs["learning_rate"]
      warmup = float(kwargs["warmup_steps"])
      decay = float(kwargs["decay_steps"])
      end = kwargs["end_learning_rate"]
      since = tf.maximum(step - warmup, 0.0)
      progress = tf.minimum(since, decay) / decay
      name = kwargs["schedule"]
      if name == "step":
        after = peak * tf.pow(0.1, tf.floor(since / decay))
      elif name == "linear":
        after = peak + (end - peak) * progress
      elif name == "cosine":
        after = end + (peak - end) * 0.5 * (1 + tf.cos(math.pi * progress))
      else:
        after = tf.constant(peak, tf.float32)
      if warmup:
        return tf.where(step < warmup, peak * step / warmup, after)
      return after

    def get_config(self):
      return dict(kwargs)

  return Schedule()


def create(name, *, schedule, weight_decay=0.0, mixed_precision="none",
           ema_decay=0.0):
  """An optimizer; `schedule` is schedule_kwargs(config). `ema_decay`:
  keep a moving average of the weights (0: none)."""
  import keras
  if name not in _OPTIMIZERS:
    raise ConfigError(f"Unrecognized optimizer: {name!r}. "
                      f"Valid: {', '.join(NAMES)}.")
  class_name, fixed = _OPTIMIZERS[name]
  rate = (schedule["learning_rate"] if schedule["schedule"] == "constant"
          and not schedule["warmup_steps"] else _keras_schedule(schedule))
  extra = {"weight_decay": weight_decay} if weight_decay else {}
  if ema_decay:
    extra.update(use_ema=True, ema_momentum=ema_decay)
  optimizer = getattr(keras.optimizers, class_name)(
      learning_rate=rate, **fixed, **extra)
  if mixed_precision == "mixed_float16":
    # float16 gradients underflow without dynamic loss scaling.
    optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
  return optimizer
