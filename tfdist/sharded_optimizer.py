"""ZeRO stage 1 for synchronous data parallelism: each of the N replicas
keeps the optimizer state of 1/N of the weights.

One step, in a replica context:
1. every trainable gradient of this replica (not yet summed) goes into one
   flat buffer, in the order of the variables;
2. the reduce-scatter (tfdist.collectives) leaves this replica the sum
   over the replicas of its shard of that buffer: 1/N of it;
3. this replica's own Keras optimizer updates its shard of the weights
   with its shard of the state (clipping, if asked, by the global norm of
   the summed gradient, which one scalar all-reduce gives);
4. the all-gather of the updated shards gives every replica the whole new
   weights, assigned to the model's mirrored variables in one merge_call.

The optimizers of tfdist's table (SGD, momentum, Adam, AdamW, RMSprop) are
element-wise, so a flat shard is updated exactly as the same elements of
the whole variables would be. The wire carries the bytes of one ring
all-reduce (tools.bench_shard_wire).

This is the update only: the CLI flag, the checkpoint layout (the whole
state, gathered on save and split on restore) and the multi-worker case
are not wired in yet.
"""

import math

import tensorflow as tf

from tfdist import collectives


def slots(optimizer):
  """The optimizer's state variables besides its step count and rate."""
  skip = {optimizer.iterations.path}
  rate = getattr(optimizer, "_learning_rate", None)
  if hasattr(rate, "path"):
    skip.add(rate.path)
  return [v for v in optimizer.variables if v.path not in skip]


class ShardedUpdate:
  """The sharded optimizer update of `variables` (a model's trainable
  variables, created under `strategy`). `make_optimizer()` gives a fresh,
  unbuilt Keras optimizer: one per local replica, each built on that
  replica's shard. Build this outside `strategy.scope()`: the shards are
  one variable per device, not mirrored ones."""

  def __init__(self, *, strategy, variables, make_optimizer, clip_norm=0.0):
    if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
      raise RuntimeError("ShardedUpdate must be built outside the "
                         "strategy's scope: its shards are per device.")
    self._strategy = strategy
    self._variables = list(variables)
    self._sizes = [math.prod(v.shape) for v in self._variables]
    self._collectives = collectives.ShardCollectives(
        strategy, length=sum(self._sizes))
    self._clip_norm = clip_norm
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

  @property
  def shard_size(self):
    return self._collectives.shard_size

  @property
  def num_shards(self):
    return self._collectives.num_shards

  def _flat(self, tensors):
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)

  def _unflat(self, flat):
    pieces = tf.split(flat, self._sizes)
    return [tf.reshape(p, v.shape) for p, v in zip(pieces, self._variables)]

  def apply(self, grads):
    """Applies this replica's `grads` (one per variable, not summed over
    the replicas) in a replica context; returns the global norm of the
    summed gradient."""
    missing = [v.path for v, g in zip(self._variables, grads) if g is None]
    if missing:
      # Keras skips a variable without a gradient; in a flat shard a zero
      # gradient would still move it (momentum), so say so instead.
      raise ValueError("the sharded optimizer needs a gradient for every "
                       f"trainable variable; these get none: {missing}")
    context = tf.distribute.get_replica_context()
    local = context._replica_id_in_sync_group % len(self.shards)  # pylint: disable=protected-access
    shards = self._collectives
    summed = shards.reduce_scatter(self._flat(
        [tf.convert_to_tensor(g) for g in grads]))
    norm = tf.sqrt(context.all_reduce(tf.distribute.ReduceOp.SUM,
                                      tf.reduce_sum(tf.square(summed))))
    if self._clip_norm:
      # As tf.clip_by_global_norm, on the summed gradient.
      summed *= self._clip_norm / tf.maximum(norm, self._clip_norm)
    rank = shards.rank()
    weights = tf.pad(self._flat([v.value for v in self._variables]),
                     [[0, shards.shard_size * shards.num_shards -
                       shards.length]])
    shard, optimizer = self.shards[local], self.optimizers[local]
    shard.assign(tf.reshape(weights, [shards.num_shards, -1])[rank])
    # Keras's order in apply(): decoupled weight decay (on every element:
    # tfdist excludes no variable), the update, the step count. Its own
    # apply() would merge_call across the replicas, whose optimizers
    # differ here.
    rate = tf.cast(optimizer.learning_rate, shard.dtype)
    if optimizer.weight_decay:
      shard.assign(shard - shard * optimizer.weight_decay * rate)
    optimizer.update_step(summed, shard, rate)
    optimizer.iterations.assign_add(1)
    new = self._unflat(shards.all_gather(shard.read_value()))

    def assign(strategy, values):
      for variable, value in zip(self._variables, values):
        strategy.extended.update(
            getattr(variable, "value", variable),
            lambda v, x: v.assign(x), args=(value,), group=False)

    context.merge_call(assign, args=(new,))
    return norm

  def ranks(self):
    """The shard each local replica holds (the order of self.optimizers
    and self.shards), as Python ints."""
    per_replica = self._strategy.run(tf.function(self._collectives.rank))
    return [int(r) for r in
            self._strategy.experimental_local_results(per_replica)]
