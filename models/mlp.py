"""A multi-layer perceptron, as a chain of named blocks (pipeline-ready)."""

import keras

from .parallel_layers import TensorParallelMLP


def mlp(*, input_shape, num_classes, hidden=(256, 256),
        tensor_parallel_devices=None):
  """With tensor_parallel_devices, the first two hidden layers are one
  column/row tensor-parallel pair."""
  del input_shape  # The chain builds on its first call.
  blocks = [keras.layers.Flatten(name="flatten")]
  widths = list(hidden)
  if tensor_parallel_devices and len(widths) >= 2:
    blocks.append(TensorParallelMLP(
        widths[0], widths[1], devices=tensor_parallel_devices,
        inner_activation="relu", outer_activation="relu", name="tp_mlp"))
    widths = widths[2:]
    first = 2
  else:
    first = 0
  for index, width in enumerate(widths, start=first):
    blocks.append(keras.layers.Dense(width, activation="relu",
                                     name=f"dense_{index}"))
  blocks.append(keras.layers.Dense(num_classes, dtype="float32",
                                   name="logits"))
  return keras.Sequential(blocks, name="mlp")


def mlp_wide(*, input_shape, num_classes, tensor_parallel_devices=None):
  """Wide enough to be compute-bound: used by the benchmarks."""
  return mlp(input_shape=input_shape, num_classes=num_classes,
             hidden=(2048, 2048),
             tensor_parallel_devices=tensor_parallel_devices)
