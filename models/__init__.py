"""The model zoo. `build(name, ...)` picks a model by its --model name."""

import importlib

from tfdist.errors import ConfigError

# name -> (module, builder). Modules load lazily so the CLI starts fast.
_REGISTRY = {
    "mlp": ("models.mlp", "mlp"),
    "mlp_wide": ("models.mlp", "mlp_wide"),
    "cnn": ("models.cnn", "cnn"),
    "resnet20": ("models.resnet", "resnet20"),
    "resnet56": ("models.resnet", "resnet56"),
    "transformer": ("models.transformer", "transformer"),
}


def names():
  return tuple(_REGISTRY)


def check_name(name):
  if name not in _REGISTRY:
    raise ConfigError(f"Unrecognized model: {name!r}. "
                      f"Valid: {', '.join(names())}.")


def build(name, *, input_shape, num_classes):
  """Builds an uncompiled Keras model that outputs float32 logits."""
  check_name(name)
  module, function = _REGISTRY[name]
  builder = getattr(importlib.import_module(module), function)
  return builder(input_shape=tuple(input_shape), num_classes=num_classes)
