"""Optimizer factory: --optimizer name to a Keras 3 optimizer."""

import keras

from tfdist.errors import ConfigError

_OPTIMIZERS = {
    "sgd": lambda lr: keras.optimizers.SGD(lr),
    "momentum": lambda lr: keras.optimizers.SGD(lr, momentum=0.9),
    "adam": lambda lr: keras.optimizers.Adam(lr),
    "adamw": lambda lr: keras.optimizers.AdamW(lr),
    "rmsprop": lambda lr: keras.optimizers.RMSprop(lr),
}


def create(name, *, learning_rate, mixed_precision="none"):
  if name not in _OPTIMIZERS:
    raise ConfigError(f"Unrecognized optimizer: {name!r}. "
                      f"Valid: {', '.join(_OPTIMIZERS)}.")
  optimizer = _OPTIMIZERS[name](learning_rate)
  if mixed_precision == "mixed_float16":
    # float16 gradients underflow without dynamic loss scaling.
    optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
  return optimizer
