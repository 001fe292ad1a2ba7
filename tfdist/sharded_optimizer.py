"""ZeRO stage 1 for synchronous data parallelism: each of the N replicas
keeps the optimizer state of 1/N of the weights.

One step, in a replica context:
1. every trainable gradient of this replica (not yet summed) is read as
   one flat buffer, in the order of the variables, bucket by bucket;
2. the reduce-scatter (tfdist.collectives) leaves this replica the sum
   over the replicas of its shard of that buffer: 1/N of each bucket;
3. this replica's own Keras optimizer updates its shard of the weights
   with its shard of the state (clipping, if asked, by the global norm of
   the summed gradient, which one scalar all-reduce gives);
4. the all-gather of the updated shards, bucket by bucket, gives every
   replica the whole new weights, assigned to the model's mirrored
   variables in one merge_call.
The buckets (32 MiB) bound what the collectives hold at once: one flat
buffer of the whole model took 3.4-3.7x a single device's memory growth
(tools.bench_replica_memory).

The optimizers of tfdist's table (SGD, momentum, Adam, AdamW, RMSprop) are
element-wise, so a flat shard is updated exactly as the same elements of
the whole variables would be. The wire carries the bytes of one ring
all-reduce (tools.bench_shard_wire).

Checkpoints hold the whole state, laid out as an unsharded run's Keras
optimizer lays it out (`checkpoint_view`): gathered before each save
(`saving`), split again after a restore (`scatter_restored`). So a sharded
run resumes on another N, or unsharded, and back.
"""

import contextlib
import functools
import math

import numpy as np
import tensorflow as tf

from tfdist import collectives
from tfdist import flat_layout
from tfdist import replica_check


def slots(optimizer):
  """The optimizer's state variables besides its step count and rate."""
  skip = {optimizer.iterations.path}
  rate = getattr(optimizer, "_learning_rate", None)
  if hasattr(rate, "path"):
    skip.add(rate.path)
  return [v for v in optimizer.variables if v.path not in skip]


def check_slot_layout(make_optimizer):
  """The checkpoint view assumes Keras's layout of an optimizer's state:
  the slots of each variable together, variable after variable. Checked
  on two stand-ins, so another Keras cannot save a wrong layout silently."""
  import keras  # pylint: disable=g-import-not-at-top
  stand_ins = [keras.Variable(tf.zeros([1]), name=f"tfdist_stand_in_{i}")
               for i in range(2)]
  template = make_optimizer()
  template.build(stand_ins)
  names = [v.path for v in slots(template)]
  per_variable = len(names) // 2
  expected = [f"tfdist_stand_in_{i}" for i in range(2)
              for _ in range(per_variable)]
  if len(names) % 2 or not all(e in n for e, n in zip(expected, names)):
    raise RuntimeError(
        "Sharding: this Keras lays out the optimizer's slots "
        f"otherwise ({names}), so the checkpoint of a sharded run would not "
        "match an unsharded one.")


def update_shards(optimizer, grads, shards, run=None):
  """Updates `shards` (this replica's, which `optimizer` was built on)
  with their summed `grads` (`update_shard` each), then counts the step.
  `run`: the run's optimizer, whose rate, decay and step count are the
  run's (default: `optimizer`). Keras's own apply() would merge_call
  across the replicas, whose optimizers differ here."""
  for grad, shard in zip(grads, shards):
    update_shard(optimizer, grad, shard, run=run)
  count_step(optimizer, run=run)


def update_shard(optimizer, grad, shard, run=None):
  """One shard's update, in Keras's order in apply(): decoupled weight
  decay (on every element: tfdist excludes no variable), then the update.
  Every shard of a step is updated before `count_step`."""
  run = run or optimizer
  rate = tf.cast(run.learning_rate, tf.float32)
  if run.weight_decay:
    shard.assign(shard - shard * run.weight_decay * rate)
  optimizer.update_step(grad, shard, rate)


def count_step(optimizer, run=None):
  optimizer.iterations.assign_add(1)
  if run is not None and run is not optimizer:
    run.iterations.assign_add(1)


class _SlotView(tf.__internal__.tracking.Trackable):
  """Slot `slot` of variable `variable`, whole, under the checkpoint key
  an unsharded run's optimizer gives it."""

  def __init__(self, owner, variable, slot):
    self._owner, self._variable, self._slot = owner, variable, slot

  def _serialize_to_tensors(self):
    return {"VARIABLE_VALUE": self._owner.whole_slot(self._variable,
                                                     self._slot)}

  def _restore_from_tensors(self, restored_tensors):
    self._owner.restored[(self._variable, self._slot)] = (
        restored_tensors["VARIABLE_VALUE"])
    return tf.no_op()


def checkpoint_view(owner, optimizer, variables, slot_count):
  """What goes into the checkpoint as `optimizer`: the children an
  unsharded run's Keras optimizer has (its step count, its rate when it
  is a variable, `variables`, and the slots of each variable in turn),
  with each slot whole: `owner.whole_slot(v, k)` saves slot k of
  variables[v], and a restore puts it in `owner.restored[(v, k)]`."""
  view = tf.__internal__.tracking.AutoTrackable()
  view._iterations = optimizer.iterations  # pylint: disable=protected-access
  kept = [optimizer.iterations]
  rate = getattr(optimizer, "_learning_rate", None)
  if hasattr(rate, "assign"):
    view._learning_rate = rate  # pylint: disable=protected-access
    kept.append(rate)
  view._trainable_variables = list(variables)  # pylint: disable=protected-access
  view._variables = kept + [  # pylint: disable=protected-access
      _SlotView(owner, v, k) for v in range(len(variables))
      for k in range(slot_count)]
  return view


def from_replica_zero(strategy, values, own=None):
  """The sum over replicas of `values` from replica 0 and `own` (or
  zeros) from every other replica."""
  reduce = tf.function(functools.partial(replica_check.from_replica_zero,
                                         strategy))
  own = np.zeros_like(values) if own is None else own
  return reduce(tf.constant(values), own=tf.constant(own)).numpy()


def share_restored(strategy, restored, entries, differs_here,
                   read_whole=None, keep=None):
  """The restored values every worker scatters its shards from, after
  ChiefBroadcast (`differs_here`: this worker's state was not the
  chief's). `restored`: {key: value} this worker read; `entries`: every
  (key, shape) a checkpoint holds. When the chief restored and some
  worker's values differ (no shared disk), each takes the chief's; a
  worker that restored nothing would otherwise train on its fresh state.
  When the chief restored nothing, nobody keeps what it read. One small
  all-reduce decides; the whole state travels only when needed, an entry
  at a time, and only the entries the chief restored.
  `read_whole()`: when what was restored is not whole, the whole values
  to send, read again ({} on a worker whose values are not sent).
  `keep(key, value)`: what a worker keeps of a received entry (all)."""
  if not entries:
    return restored
  need = float(differs_here or not restored)
  has = float(bool(restored))
  needed, chief_has = from_replica_zero(
      strategy, np.array([need, has], np.float32),
      np.array([need, 0], np.float32))
  if not chief_has:
    return {}
  if not needed:
    return restored
  if read_whole is not None:
    restored = read_whole()
  present = from_replica_zero(strategy, np.array(
      [key in restored for key, _ in entries], np.float32))
  shared = {}
  for (key, shape), sent in zip(entries, present):
    if not sent or not math.prod(shape):
      continue  # Not in the chief's checkpoint (the fresh values stay), or
      # nothing to send.
    mine = restored.pop(key, None)
    mine = (np.zeros(shape, np.float32) if mine is None
            else np.asarray(mine, np.float32))
    value = from_replica_zero(strategy, mine)
    shared[key] = keep(key, value) if keep else value
  return shared


class ShardedUpdate:
  """The sharded optimizer update of `variables` (a model's trainable
  variables, created under `strategy`). `optimizer` is the run's Keras
  optimizer, never built: its learning rate, weight decay and step count
  are the run's (callbacks may change the rate). `make_optimizer()` gives
  a fresh, unbuilt optimizer of the same kind: one per local replica, each
  built on that replica's shard. Build this outside `strategy.scope()`:
  the shards are one variable per device, not mirrored ones."""

  def __init__(self, *, strategy, variables, make_optimizer, clip_norm=0.0,
               optimizer=None, bucket_elements=collectives.BUCKET_ELEMENTS):
    collectives.check_outside_scope("ShardedUpdate")
    self._strategy = strategy
    self._variables = list(variables)
    self._layout = flat_layout.FlatLayout([v.shape for v in self._variables])
    self._collectives = collectives.ShardCollectives(
        strategy, length=self._layout.size, bucket_elements=bucket_elements)
    self._clip_norm = clip_norm
    self._optimizer = optimizer
    check_slot_layout(make_optimizer)
    self._gathered = None  # {(variable, slot): array} while saving.
    self.restored = {}  # {(variable, slot): tensor} from a restore.
    self.shards = []  # One flat weight shard per local replica.
    self.optimizers = []
    for device in strategy.extended.worker_devices:
      with tf.device(device):
        shard = tf.Variable(tf.zeros([self._collectives.shard_size]),
                            trainable=False, name="weight_shard")
        optimizer = make_optimizer()
        optimizer.build([shard])
      self.shards.append(shard)
      self.optimizers.append(optimizer)
    # Which shard each local replica holds: fixed for the strategy's life,
    # so asked once here (every worker builds this at the same point).
    self._ranks = self.ranks()

  def step_variables(self):
    """What a step differentiates: the model's own variables."""
    return self._variables

  def forward(self):
    """Around a step's forward pass: nothing to do here."""
    return contextlib.nullcontext()

  @property
  def shard_size(self):
    return self._collectives.shard_size

  @property
  def num_shards(self):
    return self._collectives.num_shards

  def owned(self, rank):
    """[(start, end)] of the flat state that shard `rank` holds."""
    return self._collectives.owned(rank)

  def _shard_of(self, tensors, rank):
    """Shard `rank` of the concatenation of `tensors` (zeros past its
    end), read from the tensors that overlap it only: the rank is fixed,
    so the slices are too."""
    pieces = [self._layout.read(tensors, start, end)
              for start, end in self._collectives.owned(rank)]
    return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)

  def apply(self, grads):
    """Applies this replica's `grads` (one per variable, not summed over
    the replicas) in a replica context."""
    # Keras skips a variable the loss does not reach. In a static graph it
    # is never reached: its slots stay zero under zero gradients, so it
    # only has to keep its weights (weight decay would move them).
    reached = [g is not None for g in grads]
    grads = [tf.zeros(v.shape) if g is None else g
             for v, g in zip(self._variables, grads)]
    context = tf.distribute.get_replica_context()
    local = collectives.local_replica(len(self.shards))
    shards = self._collectives
    grads = [tf.convert_to_tensor(g) for g in grads]
    summed = shards.reduce_scatter(
        lambda start, end: self._layout.read(grads, start, end))
    if self._clip_norm:
      # As tf.clip_by_global_norm, on the summed gradient: the shards'
      # squared norms add up to the whole's.
      norm = tf.sqrt(context.all_reduce(tf.distribute.ReduceOp.SUM,
                                        tf.reduce_sum(tf.square(summed))))
      summed *= self._clip_norm / tf.maximum(norm, self._clip_norm)
    shard, optimizer = self.shards[local], self.optimizers[local]
    shard.assign(self._shard_of([v.value for v in self._variables],
                                self._ranks[local]))
    update_shards(optimizer, [summed], [shard], run=self._optimizer)
    new = self._new_weights(shard.read_value())

    def assign(strategy, values):
      for variable, value, update in zip(self._variables, values, reached):
        if not update:
          continue
        strategy.extended.update(
            getattr(variable, "value", variable),
            lambda v, x: v.assign(x), args=(value,), group=False)

    context.merge_call(assign, args=(new,))

  def _new_weights(self, shard):
    """Every variable's new value, read from the all-gather of the
    updated shards. Bucket b + 1 is gathered once the variables that
    bucket b completed are read, so that their assigns free bucket b
    while it travels: the step holds a few buckets of the new weights,
    not the whole model again."""
    shards, layout = self._collectives, self._layout
    ends = np.cumsum(layout.sizes)
    values, buckets, waiting, read = [None] * len(ends), [], 0, []
    for b in range(shards.num_buckets):
      with tf.control_dependencies(read or buckets[-1:]):
        buckets.append(shards.gather_bucket(tf.identity(shard), b))
      last = b == shards.num_buckets - 1
      read = []
      while waiting < len(ends) and (last or ends[waiting] <=
                                     (b + 1) * shards.bucket):
        start = ends[waiting] - layout.sizes[waiting]
        values[waiting] = tf.reshape(flat_layout.read_range(
            buckets, [shards.bucket] * len(buckets), start, ends[waiting]),
                                     layout.shapes[waiting])
        read.append(values[waiting])
        waiting += 1
    return values

  def ranks(self):
    """The shard each local replica holds (the order of self.optimizers
    and self.shards), as Python ints."""
    return self._collectives.local_ranks(self._strategy)

  # Checkpoints -------------------------------------------------------------

  def _slot_count(self):
    return len(slots(self.optimizers[0]))

  def checkpoint_view(self, optimizer, variables):
    """What goes into the checkpoint as `optimizer` (see the module
    function)."""
    return checkpoint_view(self, optimizer, variables, self._slot_count())

  def whole_slot(self, variable, slot):
    """The whole value of one slot while saving; zeros otherwise (a
    restore only asks for the shape and dtype)."""
    if self._gathered is not None:
      return self._gathered[(variable, slot)]
    return tf.zeros(self._variables[variable].shape, tf.float32)

  def _gather_slots(self):
    """Every slot kind whole on every replica (the other workers' shards
    are theirs), as the buckets its all-gather gives: one list per kind."""
    count = self._slot_count()

    @tf.function
    def gather():
      def replica_fn():
        local = collectives.local_replica(len(self.shards))
        mine = slots(self.optimizers[local])
        return [self._collectives.gathered_buckets(mine[k].value)
                for k in range(count)]
      return self._strategy.experimental_local_results(
          self._strategy.run(replica_fn))[0]

    return gather() if count else []

  @contextlib.contextmanager
  def saving(self):
    """Around a checkpoint save (every worker saves together): the whole
    slots are gathered first. Each variable's slot is read from the
    gathered buckets (a slice, not a copy, where it lies in one), so the
    save holds the whole state about once, not the three times a flat
    copy, its numpy array and the tensors made from it took (1.6 GB of
    the 92.8M-parameter model's Adam state: tools.bench_replica_memory)."""
    self._gathered = {}
    for k, buckets in enumerate(self._gather_slots()):
      for v, piece in enumerate(self._layout.unflatten_pieces(
          buckets, self._collectives.bucket)):
        self._gathered[(v, k)] = piece
    try:
      yield
    finally:
      self._gathered = None

  def share_restored(self, differs_here):
    """Every worker calls this after ChiefBroadcast (`differs_here`: this
    worker's state was not the chief's); see share_restored below."""
    self.restored = share_restored(
        self._strategy, self.restored,
        [((v, k), variable.shape) for k in range(self._slot_count())
         for v, variable in enumerate(self._variables)], differs_here)

  def scatter_restored(self):
    """After a restore: each local shard takes its slice of the restored
    whole slots, and every shard optimizer the run's step count."""
    count = self._slot_count()
    if self.restored:
      for k in range(count):
        keys = [(v, k) for v in range(len(self._variables))]
        if not all(key in self.restored for key in keys):
          continue  # Not in the checkpoint: the fresh slots stay.
        flat = self._layout.flatten_numpy(
            [self.restored[key] for key in keys])
        for rank, optimizer in zip(self._ranks, self.optimizers):
          slots(optimizer)[k].assign(
              self._collectives.numpy_shard(flat, rank))
      self.restored = {}
    if self._optimizer is not None:
      for optimizer in self.optimizers:
        optimizer.iterations.assign(self._optimizer.iterations.value)
