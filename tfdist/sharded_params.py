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
assigns to it is assigned after the call.
"""

import contextlib

import numpy as np
import tensorflow as tf

from tfdist import collectives
from tfdist import flat_layout
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


def plan_units(model):
  """The model's units: each top-level layer with trainable weights.
  Raises ConfigError when a trainable weight belongs to no such layer
  (a variable the model itself owns)."""
  units = [_Unit(layer) for layer in model.layers if layer.trainable_weights]
  owned = {id(v) for unit in units for v in unit.weights}
  loose = [v.path for v in model.trainable_weights if id(v) not in owned]
  if loose:
    raise ConfigError(
        "--shard=params shards the weights of the model's layers; these "
        f"belong to no layer of model.layers: {loose}")
  shared = len(owned) != sum(len(unit.weights) for unit in units)
  if shared:
    raise ConfigError("--shard=params: two layers of the model share a "
                      "weight; share the layer instead (one unit).")
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
    if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
      raise RuntimeError("ShardedParams must be built outside the "
                         "strategy's scope: its shards are per device.")
    self._strategy = strategy
    self.units = plan_units(model)
    self._collectives = [collectives.ShardCollectives(
        strategy, length=u.layout.size, bucket_elements=u.layout.size)
                         for u in self.units]
    self._ranks = self._ask_ranks()
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
    # Per local replica (their calls are traced on threads of their own):
    # the inputs of the unit called last, and the reduce-scatter traced
    # last in the backward.
    self._previous_inputs = {}
    self._previous_reduced = {}

  def _shard_unit(self, u, devices, release):
    """Each local replica's shard of unit `u`, from the model's weights;
    then, with `release`, the whole weights are freed. A weight released
    keeps an empty variable, so that a read outside `gathering()` fails
    on its shape instead of using stale values."""
    unit, shards = self.units[u], self._collectives[u]
    flat = unit.layout.flatten_numpy([v.numpy() for v in unit.weights])
    flat = np.pad(flat, [0, shards.bucket - flat.size])
    for local, (device, rank) in enumerate(zip(devices, self._ranks)):
      (start, end), = shards.owned(rank)
      with tf.device(device):
        self.shards[local].append(
            tf.Variable(flat[start:end], name=f"unit_shard_{u}"))
    if release:
      for variable in unit.weights:
        with tf.init_scope():
          variable._value = tf.Variable(  # pylint: disable=protected-access
              tf.zeros([0], variable.dtype), trainable=False,
              name=f"released_{variable.name}")

  def _ask_ranks(self):
    rank = self._collectives[0].rank
    per_replica = self._strategy.run(tf.function(rank))
    return [int(r) for r in
            self._strategy.experimental_local_results(per_replica)]

  def _local(self):
    context = tf.distribute.get_replica_context()
    return context._replica_id_in_sync_group % len(self.shards)  # pylint: disable=protected-access

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
    unit, shards = self.units[u], self._collectives[u]
    flat = shards.gather_bucket(shard, 0)[:unit.layout.size]
    return unit.layout.unflatten(flat)

  def _reduce_scatter(self, u, grads):
    unit, shards = self.units[u], self._collectives[u]
    grads = [tf.zeros(v.shape, tf.float32) if g is None
             else tf.convert_to_tensor(g) for v, g in zip(unit.weights, grads)]
    return shards.reduce_scatter(
        lambda start, end: unit.layout.read(grads, start, end))

  @contextlib.contextmanager
  def gathering(self):
    """While on (around the model's call in a replica context), the
    units run on gathered weights; see the module docstring."""
    patched = []
    try:
      for u, unit in enumerate(self.units):
        original = unit.layer.call
        object.__setattr__(unit.layer, "call",
                           self._unit_call(u, original))
        patched.append(unit.layer)
      self._previous_inputs, self._previous_reduced = {}, {}
      yield
    finally:
      for layer in patched:
        object.__delattr__(layer, "call")

  def _unit_call(self, u, original):
    def call(*args, **kwargs):
      return self._run_unit(u, original, args, kwargs)
    return call

  def _run_unit(self, u, original, args, kwargs):
    unit = self.units[u]
    flat = tf.nest.flatten((args, kwargs))
    places = [i for i, x in enumerate(flat) if tf.is_tensor(x)]
    inputs = [flat[i] for i in places]
    states = [tf.convert_to_tensor(v.value) for v in unit.states]
    local = self._local()
    shard = self.shards[local][u].read_value()
    structure, updated = [], []

    def run(inputs, weights, track):
      values = list(flat)
      for i, x in zip(places, inputs):
        values[i] = x
      call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs),
                                                        values)
      mapping = list(zip(unit.weights, weights)) + list(
          zip(unit.states, states))
      with _stateless(mapping) as scope:
        outputs = original(*call_args, **call_kwargs)
      if track:
        structure.append(outputs)
        for variable, value in zip(unit.states, states):
          new = scope.get_current_value(variable)
          if new is not None and new is not value:
            updated.append((variable, new))
      return tf.nest.flatten(outputs)

    count = len(inputs)

    @tf.custom_gradient
    def unit_fn(*tensors):
      inputs, shard = list(tensors[:count]), tensors[count]
      with tf.control_dependencies([] if self._prefetch else inputs):
        weights = self._gather(u, shard)
      outputs = run(inputs, weights, track=True)

      def grad_fn(*upstream):
        upstream = [tf.zeros_like(o) if g is None else g
                    for o, g in zip(outputs, upstream)]
        after = [] if self._prefetch else self._previous_reduced.get(local, [])
        with tf.control_dependencies(upstream + after):
          weights = self._gather(u, tf.identity(shard))
        floating = [x for x in inputs if x.dtype.is_floating]
        with tf.GradientTape() as tape:
          tape.watch(floating + weights)
          again = run(inputs, weights, track=False)
        grads = tape.gradient(again, floating + weights,
                              output_gradients=upstream)
        by_input = iter(grads[:len(floating)])
        input_grads = [next(by_input) if x.dtype.is_floating else None
                       for x in inputs]
        reduced = self._reduce_scatter(u, grads[len(floating):])
        self._previous_reduced[local] = [reduced]
        return input_grads + [reduced]

      return outputs, grad_fn

    with tf.control_dependencies(self._previous_inputs.get(local, [])):
      results = unit_fn(*inputs, shard)
    self._previous_inputs[local] = inputs
    results = results if isinstance(results, (list, tuple)) else [results]
    for variable, value in updated:
      variable.assign(value)
    return tf.nest.pack_sequence_as(structure[0], list(results))


def _stateless(mapping):
  import keras  # pylint: disable=g-import-not-at-top
  return keras.StatelessScope(state_mapping=mapping)
