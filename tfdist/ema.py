"""--ema_decay: an exponential moving average of the weights, kept by the
optimizer (Keras's use_ema), used for eval and the export, saved in the
checkpoint with the optimizer's other variables.

Training steps with the raw weights; `averaged_weights` swaps the average
in for an eval or an export and the raw weights back after.
"""

import contextlib

import tensorflow as tf


def _pairs(optimizer):
  """(model variable, its average) pairs, or [] without --ema_decay."""
  inner = getattr(optimizer, "inner_optimizer", optimizer)
  if not getattr(inner, "use_ema", False):
    return []
  return [(variable, average) for variable, average in zip(
      inner._trainable_variables,  # pylint: disable=protected-access
      inner._model_variables_moving_average)  # pylint: disable=protected-access
          if average is not None]


@contextlib.contextmanager
def averaged_weights(optimizer):
  """Within: the model's trainable weights are their moving averages."""
  pairs = _pairs(optimizer)
  raw = [tf.identity(variable) for variable, _ in pairs]
  for variable, average in pairs:
    variable.assign(average)
  try:
    yield
  finally:
    for (variable, _), value in zip(pairs, raw):
      variable.assign(value)
