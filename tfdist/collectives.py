"""Reduce-scatter and all-gather of a flat buffer, in a replica context, on
CPU too: the collectives a sharded optimizer (ZeRO stage 1) is built on.

TF has no reduce-scatter on CPU (CollectiveReduceScatterV2 resolves only
to NCCL). An all-to-all does the same work: every replica cuts its buffer
into N rows, sends row j to rank j and sums the N rows it receives. Each
replica sends (N-1)/N of the buffer, as a ring reduce-scatter does, and
the all-gather of the shards sends as much again: together the bytes of a
ring all-reduce.

The collectives take their group key, instance keys and ordering token
from the strategy's own launchers (tf.distribute's CollectiveAllReduce),
so they are ordered with the strategy's all-reduces and share its key
space: ad hoc keys hang in one process. A MultiWorkerMirroredStrategy has
those launchers; a MirroredStrategy has them when it is built with
`mirrored_with_collectives`.

Shards follow the collective group's ranks, which need not be the replica
ids: `rank()` says which shard this replica holds.
"""

import math

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops
from tensorflow.python.ops import collective_ops

from tfdist.errors import ConfigError


def mirrored_with_collectives(devices):
  """A MirroredStrategy over `devices` whose cross-device ops are TF's
  collectives (as MultiWorkerMirroredStrategy's are), so ShardCollectives
  can run on it."""
  devices = [tf.DeviceSpec.from_string(d).to_string() for d in devices]
  return tf.distribute.MirroredStrategy(
      devices, cross_device_ops=cross_device_ops.CollectiveAllReduce(
          devices=devices, group_size=len(devices),
          options=tf.distribute.experimental.CommunicationOptions()))


class ShardCollectives:
  """Reduce-scatter and all-gather over `strategy`'s replicas, for
  buffers of `length` elements (padded to a multiple of the replicas)."""

  def __init__(self, strategy, *, length):
    launchers = getattr(getattr(strategy.extended, "_cross_device_ops",
                                None), "_launchers", None)
    if not launchers:
      raise ConfigError(
          "sharded collectives need a strategy whose all-reduce is TF's "
          "collectives (multi_worker_mirrored, or mirrored built with "
          "tfdist.collectives.mirrored_with_collectives). Received: "
          f"{type(strategy).__name__} with "
          f"{type(getattr(strategy.extended, '_cross_device_ops', None)).__name__}")
    if length < 1:
      raise ValueError(f"length must be >= 1. Received: length={length}")
    self._launchers = launchers
    self.num_shards = strategy.num_replicas_in_sync
    self.length = length
    self.shard_size = math.ceil(length / self.num_shards)

  def _launcher(self):
    context = tf.distribute.get_replica_context()
    # Global replica ids count the local replicas of each worker in turn.
    local = context._replica_id_in_sync_group % len(self._launchers)  # pylint: disable=protected-access
    return self._launchers[local]

  def _run(self, op, tensor):
    launcher = self._launcher()
    # The launcher's own keys and token: see the module docstring.
    with tf.device(launcher._device):  # pylint: disable=protected-access
      return op(tensor, launcher._group_size, launcher._group_key,  # pylint: disable=protected-access
                launcher._next_instance_key(),  # pylint: disable=protected-access
                ordering_token=launcher._get_ordering_token())  # pylint: disable=protected-access

  def reduce_scatter(self, flat):
    """This replica's shard (shard_size elements) of the sum over
    replicas of `flat` (length elements)."""
    padding = self.shard_size * self.num_shards - self.length
    rows = tf.reshape(tf.pad(flat, [[0, padding]]),
                      [self.num_shards, self.shard_size])
    received = self._run(collective_ops.all_to_all_v2, rows)
    return tf.reduce_sum(received, axis=0)

  def all_gather(self, shard):
    """Every replica's shard, in rank order: the flat buffer (length
    elements) on every replica."""
    gathered = self._run(collective_ops.all_gather_v2, shard)
    return gathered[:self.length]

  def rank(self):
    """Which shard this replica holds: its rank in the collective group."""
    context = tf.distribute.get_replica_context()
    ids = self._run(collective_ops.all_gather_v2, tf.reshape(
        tf.cast(context.replica_id_in_sync_group, tf.int32), [1]))
    return tf.argmax(tf.cast(tf.equal(
        ids, tf.cast(context.replica_id_in_sync_group, tf.int32)),
                             tf.int32), output_type=tf.int32)
