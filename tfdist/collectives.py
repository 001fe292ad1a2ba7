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

import itertools
import math

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.ops import collective_ops

from tfdist.errors import ConfigError


# TF's collective keys are process-wide, and every strategy numbers its
# groups from 1 and its instances from 100: a second strategy over the
# same devices would run its collectives as the first one's (a shape
# mismatch, or a hang). Each strategy made here numbers its groups from a
# start of its own, away from TF's default ones.
_GROUP_KEY_STARTS = itertools.count(1_000_000, 1_000)


def mirrored_with_collectives(devices):
  """A MirroredStrategy over `devices` whose cross-device ops are TF's
  collectives (as MultiWorkerMirroredStrategy's are), so ShardCollectives
  can run on it. Several can live in one process."""
  devices = [tf.DeviceSpec.from_string(d).to_string() for d in devices]
  keys = cross_device_utils.CollectiveKeys(
      group_key_start=next(_GROUP_KEY_STARTS))
  return tf.distribute.MirroredStrategy(
      devices, cross_device_ops=cross_device_ops.CollectiveAllReduce(
          devices=devices, group_size=len(devices),
          options=tf.distribute.experimental.CommunicationOptions(),
          collective_keys=keys))


# Elements of the flat buffer one reduce-scatter or all-gather carries:
# 32 MiB of float32. Buckets run one after another, so the step holds the
# buffers of one bucket, not of the whole model.
BUCKET_ELEMENTS = 8 * 2**20


def check_outside_scope(owner):
  """Per-device shards are made outside the strategy's scope (inside it,
  a variable would be mirrored): RuntimeError naming `owner` otherwise."""
  if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
    raise RuntimeError(f"{owner} must be built outside the strategy's "
                       "scope: its shards are per device.")


def local_replica(count):
  """Which of this worker's `count` replicas runs here (in a replica
  context), as a Python int: global replica ids count the local replicas
  of each worker in turn."""
  context = tf.distribute.get_replica_context()
  return context._replica_id_in_sync_group % count  # pylint: disable=protected-access


class ShardCollectives:
  """Reduce-scatter and all-gather over `strategy`'s replicas, for a flat
  buffer of `length` elements, in buckets of about `bucket_elements`.

  Bucket b holds elements [b * N * s, (b + 1) * N * s) of the buffer
  (padded with zeros past `length`); rank r holds elements
  [b * N * s + r * s, b * N * s + (r + 1) * s) of each bucket: its shard
  is those pieces, bucket after bucket (`owned`)."""

  def __init__(self, strategy, *, length, bucket_elements=BUCKET_ELEMENTS):
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
    if bucket_elements < 1:
      raise ValueError("bucket_elements must be >= 1. Received: "
                       f"bucket_elements={bucket_elements}")
    self._launchers = launchers
    self.num_shards = strategy.num_replicas_in_sync
    self.length = length
    # Buckets of equal size, at most about bucket_elements each: the
    # padding is under one element per rank and bucket.
    self.num_buckets = math.ceil(length / bucket_elements)
    # Elements of each bucket a rank holds.
    self.piece = math.ceil(length / (self.num_buckets * self.num_shards))
    self.bucket = self.piece * self.num_shards
    self.shard_size = self.num_buckets * self.piece

  def owned(self, rank):
    """[(start, end)] of the flat buffer that shard `rank` holds, in
    order (a Python int rank)."""
    return [(b * self.bucket + rank * self.piece,
             b * self.bucket + (rank + 1) * self.piece)
            for b in range(self.num_buckets)]

  def _launcher(self):
    return self._launchers[local_replica(len(self._launchers))]

  def _run(self, op, tensor):
    launcher = self._launcher()
    # The launcher's own keys and token: see the module docstring.
    with tf.device(launcher._device):  # pylint: disable=protected-access
      return op(tensor, launcher._group_size, launcher._group_key,  # pylint: disable=protected-access
                launcher._next_instance_key(),  # pylint: disable=protected-access
                ordering_token=launcher._get_ordering_token())  # pylint: disable=protected-access

  def reduce_scatter(self, read):
    """This replica's shard (shard_size elements) of the sum over
    replicas of the flat buffer; `read(start, end)` gives this replica's
    elements [start, end) of it (zeros past `length`). A bucket is read
    only once the one before it is summed: TF's executor would otherwise
    read them all at once."""
    pieces = []
    for b in range(self.num_buckets):
      with tf.control_dependencies(pieces[-1:]):
        rows = tf.reshape(read(b * self.bucket, (b + 1) * self.bucket),
                          [self.num_shards, self.piece])
      received = self._run(collective_ops.all_to_all_v2, rows)
      pieces.append(tf.reduce_sum(received, axis=0))
    return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)

  def gather_bucket(self, shard, b):
    """Bucket `b` of the flat buffer: every replica's piece of it, from
    each replica's `shard`."""
    return self._run(collective_ops.all_gather_v2,
                     shard[b * self.piece:(b + 1) * self.piece])

  def gathered_buckets(self, shard):
    """Every replica's shard, gathered bucket by bucket: the flat buffer
    cut into num_buckets pieces of `bucket` elements, each gathered once
    the one before it is."""
    buckets = []
    for b in range(self.num_buckets):
      with tf.control_dependencies(buckets[-1:]):
        buckets.append(self.gather_bucket(tf.identity(shard), b))
    return buckets

  def all_gather(self, shard):
    """The flat buffer (length elements) on every replica, from each
    replica's shard."""
    buckets = self.gathered_buckets(shard)
    whole = buckets[0] if len(buckets) == 1 else tf.concat(buckets, axis=0)
    return whole[:self.length]

  def numpy_shard(self, flat, rank):
    """Shard `rank` of the flat numpy vector `flat` (of `length`
    elements): its pieces of each bucket, zeros past the end."""
    flat = np.pad(flat, [0, self.num_buckets * self.bucket - flat.size])
    return np.concatenate([flat[start:end]
                           for start, end in self.owned(rank)])

  def local_ranks(self, strategy):
    """The shard each of this worker's replicas holds, in the order of
    the strategy's local devices, as Python ints."""
    per_replica = strategy.run(tf.function(self.rank))
    return [int(r) for r in strategy.experimental_local_results(per_replica)]

  def rank(self):
    """Which shard this replica holds: its rank in the collective group."""
    context = tf.distribute.get_replica_context()
    ids = self._run(collective_ops.all_gather_v2, tf.reshape(
        tf.cast(context.replica_id_in_sync_group, tf.int32), [1]))
    return tf.argmax(tf.cast(tf.equal(
        ids, tf.cast(context.replica_id_in_sync_group, tf.int32)),
                             tf.int32), output_type=tf.int32)
