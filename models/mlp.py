"""A multi-layer perceptron."""

import keras


def mlp(*, input_shape, num_classes, hidden=(256, 256)):
  inputs = keras.Input(input_shape, name="images")
  x = keras.layers.Flatten()(inputs)
  for index, width in enumerate(hidden):
    x = keras.layers.Dense(width, activation="relu", name=f"dense_{index}")(x)
  logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
  return keras.Model(inputs, logits, name="mlp")


def mlp_wide(*, input_shape, num_classes):
  """Wide enough to be compute-bound: used by the FLOP/s benchmark."""
  return mlp(input_shape=input_shape, num_classes=num_classes,
             hidden=(2048, 2048))
