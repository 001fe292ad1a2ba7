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
  the sum over the replicas of this replica's piece, and (for a unit
  called once, without clipping) the shard is updated with it there and
  then. So no replica holds more than a few units' whole weights or
  gradients at a time.
A unit's gather waits for the input of the unit called before it
(prefetch of one unit): TF's executor would otherwise start every gather
at the top of the step and bring the whole model back.

How one call of a unit runs on given weights, its other state (BatchNorm
statistics, a dropout seed) included: tfdist.units.

The whole weights are released once sharded; a checkpoint still saves
them whole, under an unsharded run's keys (tfdist.released), and the
optimizer's slots too, so a run resumes on any N, sharded or not
(tfdist.params_checkpoint).
"""

import contextlib
import weakref

import tensorflow as tf

from tfdist import collectives
from tfdist import params_checkpoint
from tfdist import released
from tfdist import sharded_optimizer
from tfdist import units as units_lib


class ShardedParams(params_checkpoint.ParamsCheckpoint):
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
  computes (else it waits for it). `reshard`: whether a unit's gathered
  weights die after its forward and are gathered again in the backward
  (FSDP's reshard_after_forward: 1.5x the bytes of an all-reduce), or
  live until the backward is done with them (1.0x, the whole weights
  alive through the step). `update_in_backward`: a unit's shard is
  updated as soon as its gradient is reduce-scattered, so that no two
  units' gradient shards need be alive together; not with clip_norm
  (the global norm needs them all), nor for a unit called twice in a
  step (its gradient is a sum). Build this outside `strategy.scope()`: the
  shards are one variable per device."""

  def __init__(self, *, strategy, model, make_optimizer, optimizer=None,
               clip_norm=0.0, prefetch=True, reshard=True,
               update_in_backward=True, release_model_weights=True):
    collectives.check_outside_scope("ShardedParams")
    sharded_optimizer.check_slot_layout(make_optimizer)
    self._strategy = strategy
    self._clip_norm = clip_norm
    self.units = units_lib.plan_units(model)
    self._init_checkpoint(model)
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
    self._prefetch, self._reshard = prefetch, reshard
    self._in_backward = update_in_backward and not clip_norm
    self._previous_inputs, self._previous_reduced = {}, {}
    # {outermost graph: {local replica: [calls of each unit]}}, while
    # that function is traced.
    self._calls = weakref.WeakKeyDictionary()
    self._patch = units_lib.CallPatch(self.units, self._unit_call)

  def _shard_unit(self, u, devices, release):
    """Each local replica's shard of unit `u`, from the model's weights;
    then, with `release`, the whole weights are freed: each Keras
    variable holds a released.ReleasedWeight instead, which a checkpoint saves
    whole and a read outside `gathering()` refuses."""
    unit, shards = self.units[u], self._collectives[u]
    flat = unit.layout.flatten_numpy([v.numpy() for v in unit.weights])
    if self._strategy.num_replicas_in_sync > len(devices):
      # Deferred weights come from each worker's own initializers: take
      # the first replica's, as a variable's creation would broadcast.
      flat = sharded_optimizer.from_replica_zero(self._strategy, flat)
    for local, (device, rank) in enumerate(zip(devices, self._ranks)):
      with tf.device(device):
        self.shards[local].append(tf.Variable(
            shards.numpy_shard(flat, rank), name=f"unit_shard_{u}"))
    if release:
      self._release(u)

  def _release(self, u):
    for i, variable in enumerate(self.units[u].weights):
      variable._value = released.ReleasedWeight(self, ("w", u, i), variable)  # pylint: disable=protected-access

  @property
  def weight_shards(self):
    """[local replica][unit]: the weight shards this process holds."""
    return self.shards

  def _local(self):
    return collectives.local_replica(len(self.shards))

  def variables(self):
    """This replica's shards (in a replica context), one per unit."""
    return self.shards[self._local()]

  def step_variables(self):
    """What a step differentiates: this replica's shards."""
    return self.variables()

  def forward(self):
    """Around a step's (or an eval's) forward pass."""
    return self.gathering()

  def apply(self, grads):
    """Updates this replica's shards (in a replica context) with `grads`,
    the gradients of `variables()`: already summed over the replicas by
    the backward. A unit the loss does not reach, or updated in the
    backward already (None), is left as is.
    With clip_norm, clipped by the global norm of the summed gradient,
    which one scalar all-reduce of the shards' squared norms gives."""
    local = self._local()
    pairs = [(g, s) for g, s in zip(grads, self.shards[local])
             if g is not None]
    grads = [tf.convert_to_tensor(g) for g, _ in pairs]
    if self._clip_norm:
      squares = tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])
      norm = tf.sqrt(tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.SUM, squares))
      grads = [g * (self._clip_norm / tf.maximum(norm, self._clip_norm))
               for g in grads]
    sharded_optimizer.update_shards(
        self.optimizers[local], grads, [s for _, s in pairs],
        run=self._optimizer)

  def _updates_in_backward(self, u, local, called_in):
    """Whether unit `u`'s backward updates its shard: it ran once in the
    whole function being traced (its nested functions, branches and
    loops included), in the graph its backward is in (`called_in`), and
    the forward is done (this thread is not inside `gathering()`: not a
    gradient taken within the forward)."""
    graph = tf.compat.v1.get_default_graph()
    if (not self._in_backward or self._patch.active or graph is not called_in
        or tf.executing_eagerly()):
      return False
    calls = self._calls.get(_root_graph(graph), {})
    return calls.get(local, [0] * len(self.units))[u] == 1

  def _count_call(self, u, local):
    """Counts a call of unit `u` in the outermost function being traced."""
    if not tf.executing_eagerly():
      per_local = self._calls.setdefault(
          _root_graph(tf.compat.v1.get_default_graph()), {})
      per_local.setdefault(local, [0] * len(self.units))[u] += 1

  def gathered_weights(self):
    """Every unit's whole weights, as numpy arrays in the units' order
    (all-gathered: every worker calls this together)."""
    return [[w.numpy() for w in self._whole_unit(u)]
            for u in range(len(self.units))]

  def _whole_unit(self, u):
    """Unit `u`'s whole weights, as tensors: the save's gather of its
    weights (one traced function per unit, not one per call)."""
    return self._state_fns[u](0)

  @contextlib.contextmanager
  def whole_weights(self):
    """Within (every worker enters it together): the model's variables
    hold their whole weights (not the optimizer's state), as for an
    export."""
    held = [(w, w._value) for unit in self.units for w in unit.weights]  # pylint: disable=protected-access
    for u, unit in enumerate(self.units):  # A unit's gather at a time.
      for weight, value in zip(unit.weights, self._whole_unit(u)):
        with tf.init_scope():
          weight._value = tf.Variable(value, name=weight.name)  # pylint: disable=protected-access
    try:
      yield
    finally:
      for weight, value in held:
        weight._value = value  # pylint: disable=protected-access

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

  def gathering(self):
    """While on (around the model's call, in a replica context or around
    `strategy.run`), the units run on gathered weights; see the module
    docstring. Re-entrant (tfdist.units.CallPatch)."""
    return self._patch.patched()

  def _unit_call(self, u, original):
    def call(*args, **kwargs):
      return self._run_unit(u, units_lib.UnitCall(
          self.units[u], original, args, kwargs))
    return call

  def _run_unit(self, u, call):
    """Unit `u`'s call as one custom-gradient function of its input
    tensors and this replica's shard."""
    local = self._local()
    shard = self.shards[local][u].read_value()
    count = len(call.inputs)
    self._count_call(u, local)
    called_in = tf.compat.v1.get_default_graph()

    @tf.custom_gradient
    def unit_fn(*tensors):
      inputs, shard = list(tensors[:count]), tensors[count]
      with tf.control_dependencies([] if self._prefetch else inputs):
        weights = self._gather(u, shard)
      outputs = call.run(inputs, weights, replay=False)
      kept = None if self._reshard else weights

      def grad_fn(*upstream):
        upstream = [tf.zeros_like(o) if g is None else g
                    for o, g in zip(outputs, upstream)]
        after = [] if self._prefetch else _last(self._previous_reduced,
                                                 local)
        if kept is None:
          with tf.control_dependencies(upstream + after):
            regathered = self._gather(u, shard)
        input_grads, weight_grads = call.gradients(
            inputs, regathered if kept is None else kept, upstream)
        reduced = self._reduce_scatter(u, weight_grads)
        _keep(self._previous_reduced, local, [reduced])
        if self._updates_in_backward(u, local, called_in):
          sharded_optimizer.update_shard(
              self.optimizers[local], reduced, self.shards[local][u],
              run=self._optimizer)
          return input_grads + [None]
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


def _root_graph(graph):
  """The outermost function graph `graph` is nested in (itself if none)."""
  while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
    graph = graph.outer_graph
  return graph
