"""Every replica holds the same state.

--check_replicas_every proves it: each replica checksums its own copy of
every variable; the checksums are all-gathered, and any replica that
differs from replica 0 is named. After a restore, ChiefBroadcast makes it
so.
"""

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


def from_replica_zero(strategy, values, own=None):
  """Replica 0's `values` on every replica: a SUM all-reduce to which
  every other replica gives `own` (zeros by default, so the sum is
  replica 0's; a flag each gives is summed onto it). Where strategy.run
  may be called (a tf.function)."""
  def replica_fn():
    context = tf.distribute.get_replica_context()
    sent = tf.where(tf.equal(context.replica_id_in_sync_group, 0), values,
                    tf.zeros_like(values) if own is None else own)
    return context.all_reduce(tf.distribute.ReduceOp.SUM, sent)
  return strategy.experimental_local_results(strategy.run(replica_fn))[0]


class ChiefBroadcast:
  """Gives every worker replica 0's values of `variables` (the chief's).

  After a restore, workers may hold different states: without a shared
  disk, the chief finds ckpt-100 in its model_dir while a worker finds
  none and starts at step 0. As Horovod and DDP do after a restore, the
  chief's state (weights, optimizer slots, step) is sent to every worker,
  so that none trains on a state of its own: SUM all-reduces in which
  every replica but replica 0 contributes zeros.

  The state goes in pieces of at most PIECE_BYTES, through one traced
  all-reduce per dtype called again for each piece. One all-reduce of the
  whole state held about four copies of it at once; one function per
  chunk still left each worker but the chief holding about half of every
  chunk sent, as long as its function lived (tools/bench_replica_memory;
  a collective op itself keeps nothing once it ends:
  tools/lab_collective_memory). A variable bigger than a piece spans
  several; it is held up to three times here while it is compared (its
  values, read once, the chief's, and the assign's new buffer).
  """

  PIECE_BYTES = 64 << 20

  def __init__(self, *, strategy, variables, then=None):
    self._strategy = strategy
    self._groups = _by_dtype(list(variables))
    self._send = tf.function(self._reduced_piece)
    # A collective of the same kind for state that is no variable here,
    # called with whether this worker's state differed: the whole slots
    # a sharded optimizer restored (share_restored).
    self._then = then

  def _reduced_piece(self, piece):
    return from_replica_zero(self._strategy, piece)

  def run(self):
    """Assigns the chief's values here; returns the variables' paths that
    differed from this worker's own."""
    changed = []
    # Dtype after dtype and piece after piece, in the same order on every
    # worker: each call's collective ends before the next one begins.
    for dtype, variables in self._groups:
      for variable, own, chiefs in self._received(dtype, variables):
        if not np.array_equal(own, chiefs, equal_nan=True):
          changed.append(_name(variable))
          variable.assign(chiefs.reshape(variable.shape))
    # A fresh function for a later call: the traced one, and whatever TF
    # keeps for its collectives, go now.
    self._send = tf.function(self._reduced_piece)
    if self._then:
      self._then(bool(changed))
    return changed

  def _received(self, dtype, variables):
    """(variable, its values here flat, the chief's flat), as the pieces
    come back; an empty variable has nothing to send."""
    sizes = [int(np.prod(tuple(v.shape))) for v in variables]
    variables = [v for v, size in zip(variables, sizes) if size]
    sizes = [size for size in sizes if size]
    if not variables:
      return
    length = max(1, min(self.PIECE_BYTES // dtype.size, sum(sizes)))
    piece = np.zeros([length], dtype.as_numpy_dtype)
    spans, fill, received, missing = [], 0, {}, list(sizes)
    for index, variable in enumerate(variables):
      flat = np.asarray(variable.numpy()).reshape([-1])
      received[index] = (flat, np.empty_like(flat))
      start = 0
      while start < flat.size:
        count = min(length - fill, flat.size - start)
        piece[fill:fill + count] = flat[start:start + count]
        spans.append((index, start, count, fill))
        fill, start = fill + count, start + count
        if fill == length or (start == flat.size
                              and index == len(variables) - 1):
          piece[fill:] = 0
          chiefs = self._send(tf.constant(piece)).numpy()
          for at, first, size, offset in spans:
            received[at][1][first:first + size] = chiefs[offset:
                                                         offset + size]
            missing[at] -= size
          spans, fill = [], 0
          for at in sorted(i for i in received if not missing[i]):
            yield (variables[at], *received.pop(at))


def _by_dtype(variables):
  """[(dtype, variables of it)], in a fixed order (packed reductions take
  one dtype)."""
  dtypes = [tf.as_dtype(v.dtype) for v in variables]  # Keras: a name.
  return [(dtype, [v for v, d in zip(variables, dtypes) if d == dtype])
          for dtype in sorted(set(dtypes), key=lambda d: d.name)]
