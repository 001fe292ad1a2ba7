"""Every replica holds the same state.

--check_replicas_every proves it: each replica checksums its own copy of
every variable; the checksums are all-gathered, and any replica that
differs from replica 0 is named. After a restore, ChiefBroadcast makes it
so.
"""

import functools

import numpy as np
import tensorflow as tf

from tfdist.errors import TfdistError


class ReplicaDivergenceError(TfdistError):
  exit_code = 4


def _checksum(value):
  """Position-weighted float64 sum: a changed or moved element shows."""
  flat = tf.reshape(tf.cast(value, tf.float64), [-1])
  size = tf.shape(flat, out_type=tf.int64)[0]
  weights = 1.0 + tf.cast(tf.range(size) % 7, tf.float64) / 7.0
  return tf.reduce_sum(flat * weights)


def read_value(variable):
  # A Keras variable's `value` is a property; a tf.Variable's a method.
  if callable(getattr(variable, "value", None)):
    return variable.read_value()
  return tf.convert_to_tensor(variable.value)


def _name(variable):
  return getattr(variable, "path", variable.name)


class ReplicaChecker:
  """Builds the gather function once; `check(step)` raises on divergence."""

  def __init__(self, *, strategy, variables, replicas_per_worker):
    self._strategy = strategy
    self._variables = list(variables)
    self._replicas_per_worker = replicas_per_worker
    self._gather = tf.function(self._gather_checksums)

  def _local_checksums(self):
    return tf.stack([_checksum(read_value(v)) for v in self._variables])[None]

  def _gather_checksums(self):
    per_replica = self._strategy.run(self._local_checksums)
    return self._strategy.gather(per_replica, axis=0)

  def check(self, step):
    table = self._gather().numpy()  # [replicas, variables]
    reference = table[0]
    for replica, row in enumerate(table[1:], start=1):
      # The same NaN on both sides is agreement (the loss check names it).
      same = (row == reference) | (np.isnan(row) & np.isnan(reference))
      differs = np.flatnonzero(~same)
      if differs.size:
        names = ", ".join(_name(self._variables[i]) for i in differs[:3])
        worker = replica // self._replicas_per_worker
        raise ReplicaDivergenceError(
            f"replica check at step {step}: worker {worker} (replica "
            f"{replica}) diverged from replica 0 in {differs.size} "
            f"variable(s): {names}; training stopped.")


class ChiefBroadcast:
  """Gives every worker replica 0's values of `variables` (the chief's).

  After a restore, workers may hold different states: without a shared
  disk, the chief finds ckpt-100 in its model_dir while a worker finds
  none and starts at step 0. As Horovod and DDP do after a restore, the
  chief's state (weights, optimizer slots, step) is sent to every worker,
  so that none trains on a state of its own: SUM all-reduces in which
  every replica but replica 0 contributes zeros, one chunk of at most
  CHUNK_BYTES after the other. One all-reduce of the whole state packed
  it into one buffer: with Adam, about 3 to 4 copies of the state alive
  at once on each worker (tools/bench_replica_memory).
  """

  CHUNK_BYTES = 64 << 20

  def __init__(self, *, strategy, variables, then=None):
    self._strategy = strategy
    self._variables = list(variables)
    self._chunks = _chunks(self._variables, self.CHUNK_BYTES)
    self._broadcasts = [
        tf.function(functools.partial(self._reduced_values, chunk))
        for chunk in self._chunks]
    # A collective of the same kind for state that is no variable here,
    # called with whether this worker's state differed: the whole slots
    # a sharded optimizer restored (share_restored).
    self._then = then

  def _from_replica_zero(self, chunk):
    context = tf.distribute.get_replica_context()
    is_source = tf.equal(context.replica_id_in_sync_group, 0)
    values = [read_value(v) for v in chunk]
    return context.all_reduce(
        tf.distribute.ReduceOp.SUM,
        [tf.where(is_source, value, tf.zeros_like(value))
         for value in values])

  def _reduced_values(self, chunk):
    return self._strategy.run(functools.partial(self._from_replica_zero,
                                                chunk))

  def run(self):
    """Assigns the chief's values here; returns the variables' paths that
    differed from this worker's own."""
    changed = []
    # Chunk after chunk, in the same order on every worker: each call's
    # collectives end before the next call's begin.
    for chunk, broadcast in zip(self._chunks, self._broadcasts):
      for variable, value in zip(chunk, broadcast()):
        local = self._strategy.experimental_local_results(value)[0]
        if not np.array_equal(np.asarray(variable.numpy()), local.numpy(),
                              equal_nan=True):
          changed.append(_name(variable))
          variable.assign(local)
    if self._then:
      self._then(bool(changed))
    return changed


def _chunks(variables, limit):
  """`variables` in runs of one dtype (packed reductions take one) of at
  most `limit` bytes each (a bigger variable alone), in a fixed order."""
  chunks = []
  dtypes = [tf.as_dtype(v.dtype) for v in variables]  # Keras: a name.
  for dtype in sorted(set(dtypes), key=lambda d: d.name):
    chunk, size = [], 0
    for variable in (v for v, d in zip(variables, dtypes) if d == dtype):
      nbytes = int(np.prod(tuple(variable.shape))) * dtype.size
      if chunk and size + nbytes > limit:
        chunks.append(chunk)
        chunk, size = [], 0
      chunk.append(variable)
      size += nbytes
    if chunk:
      chunks.append(chunk)
  return chunks
