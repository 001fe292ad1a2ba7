"""A small convnet."""

import keras


def cnn(*, input_shape, num_classes):
  inputs = keras.Input(input_shape, name="images")
  x = inputs
  for index, filters in enumerate((32, 64)):
    x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu",
                            name=f"conv_{index}")(x)
    x = keras.layers.MaxPooling2D(2, padding="same")(x)
  x = keras.layers.Flatten()(x)
  x = keras.layers.Dense(128, activation="relu", name="dense")(x)
  logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
  return keras.Model(inputs, logits, name="cnn")
