"""ZeRO stage 3 (fully sharded data parallelism) for a Keras 3 model on
TensorFlow, without editing the model: each of the N replicas keeps 1/N
of every trainable weight, as one flat shard per unit.

A unit is a layer of the model that owns trainable weights (a layer
called twice is one unit). While `gathering()` is on, each unit's call
runs as one custom-gradient function of its inputs and its shard:
- forward: the unit's weights are all-gathered from the replicas'
  shards, the layer runs on them (a `keras.StatelessScope` maps its
  variables to the gathered values), and the gathered weights die once
  the layer is done: only the unit's inputs are kept for the backward;
- backward: the weights are gathered again (once the unit's output
  gradient exists), the layer runs again under a tape, and the gradient
  of its weights is reduce-scattered at once: what reaches the shard is
  the sum over the replicas of this replica's piece. So no replica holds
  more than a few units' whole weights or gradients at a time.
A unit's gather waits for the input of the unit called before it
(prefetch of one unit): TF's executor would otherwise start every gather
at the top of the step and bring the whole model back.

The layer's other state (BatchNorm statistics, a dropout seed) is read
before the call and mapped in the scope too, so the backward's second
run sees the same values (the same dropout mask); what the forward
assigns to it is assigned after the call. The second run happens after
the model's call has returned, so it re-enters the forward's Keras call
context (the `training` inner layers inherit) and autocast scope
(tfdist.keras_context). What the scope would lose silently (a loss
added in the call, an assignment to a variable the unit does not own)
is refused.
"""

import contextlib
import threading

import tensorflow as tf

from tfdist import collectives
from tfdist import flat_layout
from tfdist import keras_context
from tfdist import sharded_optimizer
from tfdist.errors import ConfigError


class _Unit:
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
  units = [_Unit(layer) for layer in _unit_layers(model)]
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


class ShardedParams:
  """The sharded weights of `model` (built, its variables created under
  `strategy`) over `strategy`'s replicas, and their update.

  Each unit is sharded in turn and, with `release_model_weights`, its
  whole weights freed at once, before the optimizers' slots are made, so
  that the model's whole weights and the slots are never alive together.
  `make_optimizer()` gives a fresh, unbuilt Keras optimizer of the run's
  kind: one per local replica, built on that replica's shards.
  `optimizer`: the run's optimizer, never built, whose rate, weight decay
  and step count are the run's (default: each replica's own).
  `prefetch`: whether a unit's gather may run while the unit before it
  computes (else it waits for it). Build this outside `strategy.scope()`:
  the shards are one variable per device."""

  def __init__(self, *, strategy, model, make_optimizer, optimizer=None,
               prefetch=True, release_model_weights=True):
    collectives.check_outside_scope("ShardedParams")
    self._strategy = strategy
    self.units = plan_units(model)
    self._collectives = [collectives.ShardCollectives(
        strategy, length=u.layout.size, bucket_elements=u.layout.size)
                         for u in self.units]
    self._ranks = self._collectives[0].local_ranks(strategy)
    devices = strategy.extended.worker_devices
    self.shards = [[] for _ in devices]  # [local replica][unit]
    for u in range(len(self.units)):
      self._shard_unit(u, devices, release_model_weights)
    self._optimizer = optimizer
    self.optimizers = []
    for device, shards in zip(devices, self.shards):
      with tf.device(device):
        self.optimizers.append(make_optimizer())
        self.optimizers[-1].build(shards)
    self._prefetch = prefetch
    self._previous_inputs, self._previous_reduced = {}, {}
    self._lock, self._entered, self._own_calls = threading.Lock(), 0, []

  def _shard_unit(self, u, devices, release):
    """Each local replica's shard of unit `u`, from the model's weights;
    then, with `release`, the whole weights are freed. A weight released
    keeps an empty variable: a layer's call outside `gathering()` fails
    on its shape instead of using stale values (but a save or
    get_weights() gets empty arrays)."""
    unit, shards = self.units[u], self._collectives[u]
    flat = unit.layout.flatten_numpy([v.numpy() for v in unit.weights])
    for local, (device, rank) in enumerate(zip(devices, self._ranks)):
      with tf.device(device):
        self.shards[local].append(tf.Variable(
            shards.numpy_shard(flat, rank), name=f"unit_shard_{u}"))
    if release:
      for variable in unit.weights:
        with tf.init_scope():
          variable._value = tf.Variable(  # pylint: disable=protected-access
              tf.zeros([0], variable.dtype), trainable=False,
              name=f"released_{variable.name}")

  def _local(self):
    return collectives.local_replica(len(self.shards))

  def variables(self):
    """This replica's shards (in a replica context), one per unit."""
    return self.shards[self._local()]

  def apply(self, grads):
    """Updates this replica's shards (in a replica context) with `grads`,
    the gradients of `variables()`: already summed over the replicas by
    the backward. A unit the loss does not reach (None) is left as is."""
    local = self._local()
    pairs = [(g, s) for g, s in zip(grads, self.shards[local])
             if g is not None]
    sharded_optimizer.update_shards(
        self.optimizers[local], [g for g, _ in pairs], [s for _, s in pairs],
        run=self._optimizer)

  def gathered_weights(self):
    """Every unit's whole weights, as numpy arrays in the units' order
    (all-gathered: every worker calls this together)."""

    @tf.function
    def gather():
      def replica_fn():
        mine = self.variables()
        return [self._gather(u, mine[u].read_value())
                for u in range(len(self.units))]
      return self._strategy.experimental_local_results(
          self._strategy.run(replica_fn))[0]

    return [[w.numpy() for w in unit] for unit in gather()]

  def _gather(self, u, shard):
    """Unit `u`'s weights, whole, from every replica's `shard` of it."""
    return self.units[u].layout.unflatten(
        self._collectives[u].all_gather(shard))

  def _reduce_scatter(self, u, grads):
    unit, shards = self.units[u], self._collectives[u]
    grads = [tf.zeros(v.shape, tf.float32) if g is None
             else tf.convert_to_tensor(g) for v, g in zip(unit.weights, grads)]
    return shards.reduce_scatter(
        lambda start, end: unit.layout.read(grads, start, end))

  @contextlib.contextmanager
  def gathering(self):
    """While on (around the model's call, in a replica context or around
    `strategy.run`), the units run on gathered weights; see the module
    docstring. Re-entrant: each replica's thread may enter it (a
    merge_call switches threads inside it); the layers are patched once,
    and a `call` of the user's own on a layer is put back after."""
    with self._lock:
      if not self._entered:
        self._own_calls = [unit.layer.__dict__.get("call")
                           for unit in self.units]
        for u, unit in enumerate(self.units):
          object.__setattr__(unit.layer, "call",
                             self._unit_call(u, unit.layer.call))
      self._entered += 1
    try:
      yield
    finally:
      with self._lock:
        self._entered -= 1
        if not self._entered:
          for unit, own in zip(self.units, self._own_calls):
            if own is None:
              object.__delattr__(unit.layer, "call")
            else:
              object.__setattr__(unit.layer, "call", own)

  def _unit_call(self, u, original):
    def call(*args, **kwargs):
      return self._run_unit(u, _UnitCall(self.units[u], original, args,
                                         kwargs))
    return call

  def _run_unit(self, u, call):
    """Unit `u`'s call as one custom-gradient function of its input
    tensors and this replica's shard."""
    local = self._local()
    shard = self.shards[local][u].read_value()
    count = len(call.inputs)

    @tf.custom_gradient
    def unit_fn(*tensors):
      inputs, shard = list(tensors[:count]), tensors[count]
      with tf.control_dependencies([] if self._prefetch else inputs):
        weights = self._gather(u, shard)
      outputs = call.run(inputs, weights, replay=False)

      def grad_fn(*upstream):
        upstream = [tf.zeros_like(o) if g is None else g
                    for o, g in zip(outputs, upstream)]
        after = [] if self._prefetch else _last(self._previous_reduced,
                                                 local)
        with tf.control_dependencies(upstream + after):
          weights = self._gather(u, shard)
        input_grads, weight_grads = call.gradients(inputs, weights, upstream)
        reduced = self._reduce_scatter(u, weight_grads)
        _keep(self._previous_reduced, local, [reduced])
        return input_grads + [reduced]

      return outputs, grad_fn

    with tf.control_dependencies(_last(self._previous_inputs, local)):
      results = unit_fn(*call.inputs, shard)
    _keep(self._previous_inputs, local, call.inputs)
    return call.finish(results)


# Per local replica (the replicas are traced on threads of their own):
# the tensors traced last, with their graph, so that another trace (or
# the gradient graph of a loop) does not take another graph's tensors.


def _last(kept, local):
  graph, tensors = kept.get(local, (None, []))
  return tensors if graph is tf.compat.v1.get_default_graph() else []


def _keep(kept, local, tensors):
  kept[local] = (tf.compat.v1.get_default_graph(), tensors)


class _UnitCall:
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
    with scope:
      self._outputs = self._original(*args, **kwargs)
    self._updates = self._check_updates(scope, owned, before)
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
