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


class ChiefBroadcast:
  """Gives every worker replica 0's values of `variables` (the chief's).

  After a restore, workers may hold different states: without a shared
  disk, the chief finds ckpt-100 in its model_dir while a worker finds
  none and starts at step 0. As Horovod and DDP do after a restore, the
  chief's state (weights, optimizer slots, step) is sent to every worker,
  so that none trains on a state of its own. One SUM all-reduce in which
  every replica but replica 0 contributes zeros.
  """

  def __init__(self, *, strategy, variables, then=None):
    self._strategy = strategy
    self._variables = list(variables)
    self._broadcast = tf.function(self._reduced_values)
    # A collective of the same kind for state that is no variable here,
    # called with whether this worker's state differed: the whole slots
    # a sharded optimizer restored (share_restored).
    self._then = then

  def _from_replica_zero(self):
    context = tf.distribute.get_replica_context()
    is_source = tf.equal(context.replica_id_in_sync_group, 0)
    values = [read_value(v) for v in self._variables]
    contributed = [tf.where(is_source, value, tf.zeros_like(value))
                   for value in values]
    # One all-reduce per dtype: packed reductions take one dtype.
    reduced = [None] * len(values)
    for dtype in {value.dtype for value in values}:
      indices = [i for i, value in enumerate(values) if value.dtype == dtype]
      sums = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                [contributed[i] for i in indices])
      for i, total in zip(indices, sums):
        reduced[i] = total
    return reduced

  def _reduced_values(self):
    return self._strategy.run(self._from_replica_zero)

  def run(self):
    """Assigns the chief's values here; returns the variables' paths that
    differed from this worker's own."""
    reduced = self._broadcast()
    changed = []
    for variable, value in zip(self._variables, reduced):
      local = self._strategy.experimental_local_results(value)[0]
      if not np.array_equal(np.asarray(variable.numpy()), local.numpy(),
                            equal_nan=True):
        changed.append(_name(variable))
        variable.assign(local)
    if self._then:
      self._then(bool(changed))
    return changed
