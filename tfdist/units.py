"""The units of a sharded model (tfdist.sharded_params) and one call of a
unit's layer on weights given to it.

A unit is a layer with trainable weights, of model.layers or of a model
nested in it. A UnitCall runs the layer in a `keras.StatelessScope` that
maps its weights to the values given (gathered from the replicas'
shards) and its other state to the values read before the call; the
backward runs it again, in the forward's Keras call context and
autocast scope (tfdist.keras_context), to take its gradients. What the
scope would lose silently (a loss added in the call, an assignment to a
variable the unit does not own) is refused.
"""

import contextlib
import threading

import tensorflow as tf

from tfdist import flat_layout
from tfdist import keras_context
from tfdist.errors import ConfigError


class Unit:
  """A layer and its trainable weights (sharded) and other state (not)."""

  def __init__(self, layer):
    self.layer = layer
    self.weights = list(layer.trainable_weights)
    trainable = {id(v) for v in self.weights}
    # `variables`, not `weights`: dropout's seed state is one.
    self.states = [v for v in layer.variables if id(v) not in trainable]
    self.layout = flat_layout.FlatLayout([v.shape for v in self.weights])


def _unit_layers(model, seen=None):
  """The layers of model.layers with trainable weights, each once, and in
  place of a model nested in it, its own layers (so that a backbone is
  not one unit), unless it owns a weight outside them."""
  import keras  # pylint: disable=g-import-not-at-top
  seen = set() if seen is None else seen
  for layer in model.layers:
    if id(layer) in seen or not layer.trainable_weights:
      continue
    seen.add(id(layer))
    inner = {id(v) for sub in getattr(layer, "layers", ())
             for v in sub.trainable_weights}
    if isinstance(layer, keras.Model) and all(
        id(v) in inner for v in layer.trainable_weights):
      yield from _unit_layers(layer, seen)
    else:
      yield layer


def plan_units(model):
  """The model's units: each layer of model.layers (or of a model nested
  in it) with trainable weights. Raises ConfigError when the model has
  no trainable weights (or is not built), when a trainable weight
  belongs to no such layer (a variable the model itself owns), when two
  layers share a weight, or when a weight has a regularizer or a
  constraint (Keras computes the one and applies the other on the whole
  weight, which is released)."""
  if not model.trainable_weights:
    raise ConfigError(f"sharded weights: model {model.name} has no "
                      "trainable weights (is it built?)")
  units = [Unit(layer) for layer in _unit_layers(model)]
  owned = {id(v) for unit in units for v in unit.weights}
  loose = [v.path for v in model.trainable_weights if id(v) not in owned]
  if loose:
    raise ConfigError(
        "sharded weights are the weights of the model's layers; these "
        f"belong to no layer of model.layers: {loose}")
  if len(owned) != sum(len(unit.weights) for unit in units):
    raise ConfigError("sharded weights: two layers of the model share a "
                      "weight; share the layer instead (one unit).")
  for kind in ("regularizer", "constraint"):
    found = [v.path for unit in units for v in unit.weights
             if getattr(v, kind, None) is not None]
    if found:
      raise ConfigError(f"sharded weights: a weight {kind} works on the "
                        f"whole weight; these have one: {found}")
  return units


# TF's stateful random ops (each run draws anew).
_STATEFUL_RANDOM = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "ParameterizedTruncatedNormal", "RandomShuffle",
    "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt",
    "StatefulStandardNormalV2", "StatefulTruncatedNormal",
    "StatefulRandomBinomial"})


class UnitCall:
  """One call of a unit's layer: its arguments, with each distinct input
  tensor once (attention's query and value, passed as one tensor, would
  otherwise each get the whole gradient), its state as read before the
  call, and Keras's call context (`training` as the outer call set it)
  and autocast scope, which the backward's second run re-enters: that
  run happens once the model's call has returned."""

  def __init__(self, unit, original, args, kwargs):
    self.unit, self._original = unit, original
    self._structure = (args, kwargs)
    self._flat = tf.nest.flatten((args, kwargs))
    self.inputs, self._places, seen = [], [], {}
    for i, x in enumerate(self._flat):
      if tf.is_tensor(x):
        if x.ref() not in seen:
          seen[x.ref()] = len(self.inputs)
          self.inputs.append(x)
        self._places.append((i, seen[x.ref()]))
    self._context = keras_context.capture()
    with keras_context.no_autocast():  # The states' own dtype.
      self._states = [tf.convert_to_tensor(v.value) for v in unit.states]
    self._outputs, self._updates = None, []

  def run(self, inputs, weights, replay):
    """The layer's outputs (flat) on `inputs` and `weights`. The forward
    (replay False) keeps the outputs' structure and the state's updates;
    the backward's run (replay True) re-enters the forward's context."""
    values = list(self._flat)
    for i, k in self._places:
      values[i] = inputs[k]
    args, kwargs = tf.nest.pack_sequence_as(self._structure, values)
    mapping = list(zip(self.unit.weights, weights)) + list(
        zip(self.unit.states, self._states))
    scope = keras_context.stateless(mapping)
    if replay:
      with keras_context.entered(self._context), scope:
        return tf.nest.flatten(self._original(*args, **kwargs))
    owned = self.unit.weights + self.unit.states
    before = [scope.get_current_value(v) for v in owned]
    graph = tf.compat.v1.get_default_graph()
    ops_before = len(graph.get_operations())
    with scope:
      self._outputs = self._original(*args, **kwargs)
    self._updates = self._check_updates(scope, owned, before)
    self._check_random(graph.get_operations()[ops_before:])
    return tf.nest.flatten(self._outputs)

  def _check_updates(self, scope, owned, before):
    """The states' new values; ConfigError for what the scope would lose:
    a loss added by a layer inside the unit, an assignment to the unit's
    trainable weights or to a variable it does not own."""
    layer = self.unit.layer.name
    if scope.losses:
      raise ConfigError(f"sharded weights: layer {layer} (or a layer "
                        "inside it) adds a loss in its call (add_loss, or "
                        "an inner layer's activity regularizer).")
    after = [scope.get_current_value(v) for v in owned]
    weights = len(self.unit.weights)
    if any(a is not b for a, b in zip(after[:weights], before[:weights])):
      raise ConfigError(f"sharded weights: layer {layer} assigns its own "
                        "trainable weights in its call.")
    if keras_context.assigned_count(scope) > len(owned):
      raise ConfigError(
          f"sharded weights: layer {layer} assigns a variable it does not "
          "own (a layer's state outside it, or an unseeded keras.random "
          "draw).")
    return [(v, a) for v, a, b in zip(owned[weights:], after[weights:],
                                      before[weights:]) if a is not b]

  def _check_random(self, ops):
    """ConfigError for a TF stateful random op traced in the call
    (tf.nn.dropout, tf.random.uniform): the backward's second run would
    draw another mask. Keras's seeded ops are stateless (and mapped)."""
    drawn = sorted({op.type for op in ops if op.type in _STATEFUL_RANDOM})
    if drawn:
      raise ConfigError(
          f"sharded weights: layer {self.unit.layer.name} draws TF stateful "
          f"random numbers ({', '.join(drawn)}), which its backward's second "
          "run would draw again, differently; use keras.layers.Dropout or "
          "keras.random with a SeedGenerator.")

  def gradients(self, inputs, weights, upstream):
    """The gradients of the inputs (None for the non-float ones) and of
    the weights, from the layer run again on `weights`."""
    floating = [x for x in inputs if x.dtype.is_floating]
    with tf.GradientTape() as tape:
      tape.watch(floating + weights)
      outputs = self.run(inputs, weights, replay=True)
    grads = tape.gradient(outputs, floating + weights,
                          output_gradients=upstream)
    by_input = iter(grads[:len(floating)])
    return ([next(by_input) if x.dtype.is_floating else None
             for x in inputs], grads[len(floating):])

  def finish(self, results):
    """The call's outputs, structured as the layer's; the state's
    updates assigned."""
    results = results if isinstance(results, (list, tuple)) else [results]
    for variable, value in self._updates:
      variable.assign(value)
    return tf.nest.pack_sequence_as(self._outputs, list(results))


class CallPatch:
  """While `patched()`, each unit's layer.call is `make_call(u, call)`.
  Re-entrant: each replica's thread may enter it (a merge_call switches
  threads inside it); the layers are patched once, and a `call` of the
  user's own on a layer is put back after."""

  def __init__(self, units, make_call):
    self._units, self._make_call = units, make_call
    self._lock, self._entered, self._own_calls = threading.Lock(), 0, []
    self._thread = threading.local()

  @property
  def active(self):
    """Whether this thread is within `patched()`."""
    return getattr(self._thread, "depth", 0) > 0

  @contextlib.contextmanager
  def patched(self):
    with self._lock:
      if not self._entered:
        self._own_calls = [unit.layer.__dict__.get("call")
                           for unit in self._units]
        for u, unit in enumerate(self._units):
          object.__setattr__(unit.layer, "call",
                             self._make_call(u, unit.layer.call))
      self._entered += 1
    self._thread.depth = getattr(self._thread, "depth", 0) + 1
    try:
      yield
    finally:
      self._thread.depth -= 1
      with self._lock:
        self._entered -= 1
        if not self._entered:
          self._put_back()

  def _put_back(self):
    for unit, own in zip(self._units, self._own_calls):
      if own is None:
        object.__delattr__(unit.layer, "call")
      else:
        object.__setattr__(unit.layer, "call", own)
