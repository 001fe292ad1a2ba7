"""tfdist.sharded_params's plan of units and its refusals, in process.
Its numbers (one device's weights, BatchNorm, dropout, a layer called
twice, on mirrored and two MultiWorkerMirrored processes) are
tests/test_collectives.py's."""

import keras
import pytest
import tensorflow as tf

from tfdist import collectives
from tfdist import sharded_params
from tfdist.errors import ConfigError


def _strategy():
  return collectives.mirrored_with_collectives(["/cpu:0", "/cpu:1"])


def _sgd():
  return keras.optimizers.SGD(0.1)


def test_each_layer_with_weights_is_a_unit():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                            keras.layers.Dropout(0.1),
                            keras.layers.BatchNormalization(),
                            keras.layers.Dense(2)])
  units = sharded_params.plan_units(model)
  assert [u.layer.name for u in units] == [
      model.layers[i].name for i in (0, 2, 3)]
  assert [u.layout.size for u in units] == [15, 6, 8]
  assert [len(u.states) for u in units] == [0, 2, 0]


def test_a_weight_the_model_owns_is_refused():
  class Scaled(keras.Model):
    def __init__(self):
      super().__init__()
      self.dense = keras.layers.Dense(2)
      self.scale = self.add_weight(shape=(), initializer="ones",
                                   name="scale")

    def call(self, x):
      return self.dense(x) * self.scale

  model = Scaled()
  model(tf.ones([1, 3]))
  with pytest.raises(ConfigError, match="belong to no layer.*scale"):
    sharded_params.plan_units(model)


def test_a_weight_two_layers_share_is_refused():
  class Tied(keras.layers.Layer):
    def __init__(self, other):
      super().__init__()
      self.other = other

    def call(self, x):
      return tf.matmul(x, self.other.kernel, transpose_b=True)

  dense = keras.layers.Dense(3)
  inputs = keras.Input((3,))
  model = keras.Model(inputs, Tied(dense)(dense(inputs)))
  with pytest.raises(ConfigError, match="share a weight"):
    sharded_params.plan_units(model)


def test_a_weight_regularizer_is_refused():
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
      2, kernel_regularizer="l2")])
  with pytest.raises(ConfigError, match="regularizer.*kernel"):
    sharded_params.plan_units(model)


def test_gathering_puts_the_layers_back_even_when_the_call_fails():
  strategy = _strategy()
  with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  sharded = sharded_params.ShardedParams(strategy=strategy, model=model,
                                         make_optimizer=_sgd)
  with pytest.raises(RuntimeError, match="inside"):
    with sharded.gathering():
      assert "call" in vars(model.layers[0])
      raise RuntimeError("inside")
  assert "call" not in vars(model.layers[0])


def test_a_released_weight_is_not_read_outside_gathering():
  strategy = _strategy()
  with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  whole = [v.numpy() for v in model.trainable_variables]
  sharded = sharded_params.ShardedParams(strategy=strategy, model=model,
                                         make_optimizer=_sgd)
  with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
    model(tf.ones([1, 3]))
  [gathered] = sharded.gathered_weights()
  for got, want in zip(gathered, whole, strict=True):
    assert (got == want).all()


def test_it_is_built_outside_the_strategys_scope():
  strategy = _strategy()
  with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(RuntimeError, match="outside"):
      sharded_params.ShardedParams(strategy=strategy, model=model,
                                   make_optimizer=_sgd)
