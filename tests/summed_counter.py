"""A user's model with a variable of aggregation="sum": a count of the
examples seen, added to on each call (--model=tests.summed_counter:build)."""

import keras


class CountingDense(keras.layers.Dense):

  def build(self, input_shape):
    super().build(input_shape)
    self.seen = self.add_weight(shape=(), initializer="zeros",
                                trainable=False, aggregation="sum",
                                name="examples_seen")

  def call(self, inputs, training=None):
    if training:
      self.seen.assign_add(keras.ops.cast(keras.ops.shape(inputs)[0],
                                          "float32"))
    return super().call(inputs)


def build():
  return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                           CountingDense(10)])
