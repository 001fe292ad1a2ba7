"""Models that --shard=params refuses (tests/test_shard_optimizer.py):
one reads a layer's weight outside that layer's call (weight tying), one
draws a TF stateful random mask inside a unit. And one it cannot build
deferred (a variable made from a value), which it builds whole first."""

import keras
import numpy as np
import tensorflow as tf


class Tied(keras.Model):
  """Reads a layer's weight outside that layer's call (weight tying)."""

  def __init__(self):
    super().__init__()
    self.flat = keras.layers.Flatten()
    self.up = keras.layers.Dense(16)
    self.out = keras.layers.Dense(10)

  def call(self, x):
    h = self.up(self.flat(x))
    h = h + tf.reduce_sum(self.up.kernel)
    return self.out(h)


class RandomInside(keras.layers.Layer):
  def build(self, shape):
    self.kernel = self.add_weight(shape=(shape[-1], 10))

  def call(self, x, training=None):
    if training:
      x = tf.nn.dropout(x, 0.5)
    return tf.matmul(x, self.kernel)


def tied():
  return Tied()


def random_inside():
  return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                           RandomInside()])


def keeps_best_weights():
  """--callbacks: a callback that keeps the model's whole weights."""
  return [keras.callbacks.EarlyStopping(restore_best_weights=True)]


class FromValue(keras.layers.Layer):
  """A weight made from a value, not an initializer: Keras cannot defer
  it, so --shard=params builds this model whole before sharding it."""

  def build(self, shape):
    self.kernel = self.add_weight(shape=(shape[-1], 10))
    self.offset = keras.Variable(np.linspace(-1, 1, 10).astype("float32"))

  def call(self, x):
    return tf.matmul(x, self.kernel) + self.offset


def from_value():
  return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                           keras.layers.Dense(16, activation="relu"),
                           FromValue()])


def seeded_by_task():
  """Each MWMS worker draws other initial weights (its task's seeds), as
  an initializer seeded outside --seed would: a deferred build must take
  the first worker's, as a whole build's variables would."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  task = json.loads(os.environ.get("TF_CONFIG", "{}")).get(
      "task", {}).get("index", 0)
  return keras.Sequential([
      keras.Input((8, 8, 1)), keras.layers.Flatten(),
      keras.layers.Dense(16, activation="relu",
                         kernel_initializer=keras.initializers.HeNormal(
                             seed=10 + task)),
      keras.layers.Dense(10, kernel_initializer=keras.initializers.
                         GlorotUniform(seed=20 + task))])
