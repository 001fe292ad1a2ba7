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

import collections
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


def build_deferred(build):
  """`build()` (the model, for --shard=params) with its variables created
  without values; Keras fills a deferred variable's reads from its
  initializer. Returns (model, None), or (None, why) when the model
  cannot be built so: Keras's names and deferred list are then as
  before, for a whole build. It cannot when it makes a variable from a
  value, assigns one while it is built (loaded weights, which the scope
  would drop), or has an initializer that is not a Keras one seeded by
  an int (its reads would not all give the same values)."""
  names = global_state.get_global_attribute("object_name_uids")
  names = collections.defaultdict(int, names or {})
  why = None
  try:
    with keras.StatelessScope(initialize_variables=False) as scope:
      model = build()
  except (ValueError, ConfigError) as e:
    if "stateless scope" not in str(e):
      forget_deferred()
      raise
    why = "makes a variable from a value"
  else:
    if scope.state_mapping:
      why = "assigns a value to a variable while it is built"
    else:
      why = _unrepeatable(_pending())
  if why is None:
    return model, None
  forget_deferred()
  global_state.set_global_attribute("object_name_uids", names)
  return None, why


def _unrepeatable(variables):
  """Why a read of some deferred variable may not repeat, or None."""
  for variable in variables:
    initializer = variable._initializer  # pylint: disable=protected-access
    # A class's or a function's own module (Keras's seed state has one).
    if not (getattr(initializer, "__module__", None) or "").startswith(
        "keras."):
      return (f"initializes {variable.path} with "
              f"{getattr(initializer, '__name__', type(initializer).__name__)}"
              ", not a Keras initializer")
    if isinstance(getattr(initializer, "seed", 0), keras.random.SeedGenerator):
      return (f"seeds the initializer of {variable.path} with a "
              "SeedGenerator")
  return None


def _pending():
  return global_state.get_global_attribute("uninitialized_variables") or []


def initialize_held():
  """After sharding, under the strategy's scope: every variable still
  deferred (a BatchNorm's statistics, a seed) gets its value, as Keras
  would at the end of a StatelessScope, but for the released weights."""
  pending = _pending()
  global_state.set_global_attribute("uninitialized_variables", [])
  for variable in pending:
    if variable._value is None:  # pylint: disable=protected-access
      variable._deferred_initialize()  # pylint: disable=protected-access


def forget_deferred():
  """After a build that could not be deferred, or a start-up that failed
  before `initialize_held`: its variables are gone."""
  global_state.set_global_attribute("uninitialized_variables", [])


@contextlib.contextmanager
def forgotten_on_failure():
  """Around the start-up between a deferred build and `initialize_held`:
  if it fails, the model's deferred variables die with it (else a later
  run in this process would give them values)."""
  try:
    yield
  except BaseException:
    forget_deferred()
    raise
