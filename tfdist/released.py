"""What a Keras variable holds once tfdist.sharded_params has sharded it
and freed its whole value: its checkpoint entry (Keras's TF variable
delegates its save and restore to its `_value`, pinned in
tests/test_private_apis.py), and a one-line refusal of any other read.

And how its whole value is never made at all: the model is built with
its variables deferred (a Keras StatelessScope creates them without
values), each unit's whole weights come from their initializers only to
be sharded, and the variables no unit shards are given their values
after (`initialize_held`).
"""

import contextlib

import keras
from keras.src.backend.common import global_state  # pylint: disable=g-direct-keras-import
import tensorflow as tf

from tfdist.errors import ConfigError


class ReleasedWeight(tf.__internal__.tracking.Trackable):
  """What a released Keras variable holds in place of its value: its
  checkpoint entry, whole (gathered while saving; what a restore reads
  is kept for the shards). Read elsewhere, it says why it cannot be."""

  def __init__(self, owner, key, variable):
    self._owner, self._key = owner, key
    self.shape, self.dtype = variable.shape, variable.dtype
    self._path = variable.path

  def _serialize_to_tensors(self):
    return {"VARIABLE_VALUE": self._owner.whole(self._key)}

  def _restore_from_tensors(self, restored_tensors):
    self._owner.restored[self._key] = restored_tensors["VARIABLE_VALUE"]
    return tf.no_op()

  def __tf_tensor__(self, *args, **kwargs):
    del args, kwargs
    raise ConfigError(
        f"sharded weights: {self._path} is read or set outside its own "
        "layer's call (weight tying, get_weights, set_weights), but only "
        "that call sees it whole.")

  __array__ = numpy = read_value = assign = assign_add = assign_sub = (
      __tf_tensor__)

  @property
  def _shared_name(self):
    return self._path


def held_weights(model):
  """The model's weights whose values it holds: all but those a
  ShardedParams released."""
  return [w for w in model.weights
          if not isinstance(getattr(w, "_value", None), ReleasedWeight)]


@contextlib.contextmanager
def deferred():
  """Around building a model for --shard=params: its variables are
  created without values (Keras fills a deferred variable's reads from
  its initializer, which is seeded, so the values are the same)."""
  with keras.StatelessScope(initialize_variables=False):
    yield


def initialize_held():
  """After sharding, under the strategy's scope: every variable still
  deferred (a BatchNorm's statistics, a seed) gets its value, as Keras
  would at the end of a StatelessScope, but for the released weights."""
  pending = global_state.get_global_attribute("uninitialized_variables")
  global_state.set_global_attribute("uninitialized_variables", [])
  for variable in pending or []:
    if variable._value is None:  # pylint: disable=protected-access
      variable._deferred_initialize()  # pylint: disable=protected-access


def forget_deferred():
  """After a build that could not be deferred: its variables are gone."""
  global_state.set_global_attribute("uninitialized_variables", [])
