"""The model zoo (installed as tfdist.models). `build(name, ...)` picks a
model by its --model name."""

import importlib
import inspect

from tfdist.errors import ConfigError

# name -> (module, builder). Modules load lazily so the CLI starts fast.
_REGISTRY = {
    "mlp": (".mlp", "mlp"),
    "mlp_wide": (".mlp", "mlp_wide"),
    "cnn": (".cnn", "cnn"),
    "resnet20": (".resnet", "resnet20"),
    "resnet56": (".resnet", "resnet56"),
    "transformer": (".transformer", "transformer"),
    "embedding_bag": (".embedding_bag", "embedding_bag"),
}


def names():
  return tuple(_REGISTRY)


def check_name(name):
  if name not in _REGISTRY:
    raise ConfigError(f"Unrecognized model: {name!r}. "
                      f"Valid: {', '.join(names())}.")


def build(name, *, input_shape, num_classes, partitioner=None,
          tensor_parallel_devices=None):
  """Builds an uncompiled Keras model that outputs float32 logits.

  Chain models (mlp, transformer) come back as an unbuilt keras.Sequential
  of named blocks, so that a placement plan can put blocks on devices
  before their variables exist. `partitioner` (PS sharding) and
  `tensor_parallel_devices` reach the builders that take them.
  """
  check_name(name)
  module, function = _REGISTRY[name]
  builder = getattr(importlib.import_module(module, __name__), function)
  accepted = inspect.signature(builder).parameters
  options = {}
  if partitioner is not None and "partitioner" in accepted:
    options["partitioner"] = partitioner
  if tensor_parallel_devices:
    if "tensor_parallel_devices" not in accepted:
      raise ConfigError(f"model {name!r} has no tensor-parallel form; "
                        "use mlp or transformer.")
    options["tensor_parallel_devices"] = list(tensor_parallel_devices)
  return builder(input_shape=tuple(input_shape), num_classes=num_classes,
                 **options)
