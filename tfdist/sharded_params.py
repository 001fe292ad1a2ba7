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

How one call of a unit runs on given weights, its other state (BatchNorm
statistics, a dropout seed) included: tfdist.units.

The whole weights are released once sharded; a checkpoint still saves
them whole, under an unsharded run's keys (tfdist.released), and the
optimizer's slots too (`checkpoint_view`), so a run resumes on any N,
sharded or not.
"""

import contextlib
import functools
import threading

import tensorflow as tf

from tfdist import collectives
from tfdist import piecewise_save
from tfdist import released
from tfdist import sharded_optimizer
from tfdist import units as units_lib


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
  computes (else it waits for it). `reshard`: whether a unit's gathered
  weights die after its forward and are gathered again in the backward
  (FSDP's reshard_after_forward: 1.5x the bytes of an all-reduce), or
  live until the backward is done with them (1.0x, the whole weights
  alive through the step). Build this outside `strategy.scope()`: the
  shards are one variable per device."""

  def __init__(self, *, strategy, model, make_optimizer, optimizer=None,
               clip_norm=0.0, prefetch=True, reshard=True,
               release_model_weights=True):
    collectives.check_outside_scope("ShardedParams")
    sharded_optimizer.check_slot_layout(make_optimizer)
    self._strategy = strategy
    self._clip_norm = clip_norm
    self.units = units_lib.plan_units(model)
    # Where each of model.trainable_variables lies: (unit, index in it).
    # The checkpoint keys the slots by the model's order, as Keras does.
    where = {id(w): (u, i) for u, unit in enumerate(self.units)
             for i, w in enumerate(unit.weights)}
    self._model_order = [where[id(w)] for w in model.trainable_variables]
    self._variable_at = {ui: v for v, ui in enumerate(self._model_order)}
    self._piecewise = None  # A piecewise_save.PiecewiseSave while saving.
    # One function per unit: one trace each, not a retrace per unit.
    self._unit_state_fns = [
        tf.function(functools.partial(self._gather_unit_state, u))
        for u in range(len(self.units))]
    self.restored = {}  # {key: value} from a restore.
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
    self._previous_inputs, self._previous_reduced = {}, {}
    self._lock, self._entered, self._own_calls = threading.Lock(), 0, []

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
    the backward. A unit the loss does not reach (None) is left as is.
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

  def gathered_weights(self):
    """Every unit's whole weights, as numpy arrays in the units' order
    (all-gathered: every worker calls this together)."""
    return [[w.numpy() for w in self._whole_unit(u)]
            for u in range(len(self.units))]

  def _whole_unit(self, u):
    """Unit `u`'s whole weights, as tensors."""
    @tf.function
    def gather():
      def replica_fn():
        return self._gather(u, self.variables()[u].read_value())
      return self._strategy.experimental_local_results(
          self._strategy.run(replica_fn))[0]
    return gather()

  def _unit_keys(self, u):
    """The checkpoint keys of unit `u`'s state: [kind][weight], its
    weights' first, then each slot kind's."""
    count = range(len(self.units[u].weights))
    return [[("w", u, i) for i in count]] + [
        [(self._variable_at[(u, i)], k) for i in count]
        for k in range(self._slot_count())]

  def _unit_state(self, u):
    """{key: whole value} of unit `u`'s weights and slots, as tensors."""
    keys = [key for kind in self._unit_keys(u) for key in kind]
    return dict(zip(keys, self._unit_state_fns[u](), strict=True))

  def _gather_unit_state(self, u):
    """Traced once per unit: its weights, then each slot kind's (the
    order of `_unit_keys`)."""
    def replica_fn():
      local = self._local()
      held = sharded_optimizer.slots(self.optimizers[local])
      count = self._slot_count()
      flats = [self.shards[local][u].read_value()] + [
          tf.convert_to_tensor(held[u * count + k]) for k in range(count)]
      return [w for flat in flats for w in self._gather(u, flat)]
    return self._strategy.experimental_local_results(
        self._strategy.run(replica_fn))[0]

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

  # Checkpoints: the layout of an unsharded run ---------------------------

  def _slot_count(self):
    return len(sharded_optimizer.slots(self.optimizers[0])) // len(
        self.units)

  def checkpoint_view(self, optimizer, variables):
    """What goes into the checkpoint as `optimizer` (the model's weights
    save themselves, whole, through their ReleasedWeight)."""
    return sharded_optimizer.checkpoint_view(self, optimizer, variables,
                                             self._slot_count())

  def whole(self, key):
    """While saving, a value-less entry whose value `saving()` writes
    later; zeros otherwise (a restore only asks for the shape and dtype)."""
    if self._piecewise is not None:
      return self._piecewise.entry(key, tf.float32)
    u, i = key[1:] if key[0] == "w" else self._model_order[key[0]]
    return tf.zeros(self.units[u].weights[i].shape, tf.float32)

  def whole_slot(self, variable, slot):
    return self.whole((variable, slot))

  @contextlib.contextmanager
  def saving(self):
    """Around a checkpoint save (every worker saves together). Gives what
    writes the sharded entries once TF has written the rest: a unit's
    weights and slots gathered and written at a time, so the save holds
    one unit whole, not the whole state (tfdist.piecewise_save)."""
    self._piecewise = piecewise_save.PiecewiseSave(
        device=self.shards[0][0].device)
    save = self._piecewise

    def write(path):
      save.write(path, (self._unit_state(u) for u in range(len(self.units))))

    try:
      yield write
    finally:
      self._piecewise = None

  def _entries(self):
    """Every (key, shape) of the checkpoint's sharded state."""
    return [(key, unit.weights[i].shape)
            for u, unit in enumerate(self.units)
            for kind in self._unit_keys(u) for i, key in enumerate(kind)]

  def share_restored(self, differs_here):
    """After ChiefBroadcast: see sharded_optimizer.share_restored."""
    self.restored = sharded_optimizer.share_restored(
        self._strategy, self.restored, self._entries(), differs_here)

  def scatter_restored(self):
    """After a restore: each local shard takes its slice of the restored
    weights and slots, and every shard optimizer the run's step count."""
    if self.restored:
      count = self._slot_count()
      for u, unit in enumerate(self.units):
        for kind, keys in enumerate(self._unit_keys(u)):
          if not all(k in self.restored for k in keys):
            continue  # Not in the checkpoint: the fresh values stay.
          flat = unit.layout.flatten_numpy([self.restored[k] for k in keys])
          for local, rank in enumerate(self._ranks):
            target = (self.shards[local][u] if kind == 0 else
                      sharded_optimizer.slots(self.optimizers[local])[
                          u * count + kind - 1])
            target.assign(self._collectives[u].numpy_shard(flat, rank))
      self.restored = {}
    if self._optimizer is not None:
      for optimizer in self.optimizers:
        optimizer.iterations.assign(self._optimizer.iterations.value)

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
      return self._run_unit(u, units_lib.UnitCall(
          self.units[u], original, args, kwargs))
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
