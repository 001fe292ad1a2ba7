"""What a loop call sends back: the per-replica sums, packed into one
vector so that a call adds one small reduction, not one per quantity.

The layout (train): [loss sum, one-hot of the first non-finite step (slot
steps_per_loop: none), SIGTERM flag, metric states...]; (eval, float64 so
counts stay exact): [loss sum, examples, SIGTERM flag, metric states...].
"""

import dataclasses
from typing import List, NamedTuple, Optional

import numpy as np
import tensorflow as tf

# Keras code and these packers need no autograph (see compiled_loops).
_PLAIN = tf.autograph.experimental.do_not_convert


@dataclasses.dataclass
class LoopSums:
  """What loop calls bring back to the host, summed over the calls."""

  steps: int = 0
  loss_sum: float = 0.0  # Train: sum of per-step losses; eval: per example.
  examples: float = 0.0  # Eval only: real (weight 1) examples.
  first_nonfinite: Optional[int] = None  # Step offset within these sums.
  metric_states: Optional[List[List[np.ndarray]]] = None
  # Some task got SIGTERM: every task stops after this call (the flag
  # travels in the reduced vector, so all of them see it at once).
  stop: bool = False
  # Train: seconds this host's loop waited for its batches (not reduced
  # over hosts: the last slot of a train call's vector).
  input_wait: float = 0.0

  def add(self, other: "LoopSums") -> "LoopSums":
    first = self.first_nonfinite
    if first is None and other.first_nonfinite is not None:
      first = self.steps + other.first_nonfinite
    states = other.metric_states if self.metric_states is None else [
        [a + b for a, b in zip(mine, theirs)]
        for mine, theirs in zip(self.metric_states, other.metric_states)]
    return LoopSums(steps=self.steps + other.steps,
                    loss_sum=self.loss_sum + other.loss_sum,
                    examples=self.examples + other.examples,
                    first_nonfinite=first, metric_states=states,
                    stop=self.stop or other.stop,
                    input_wait=self.input_wait + other.input_wait)


class TrainState(NamedTuple):
  loss: tf.Tensor
  first_nonfinite: tf.Tensor  # -1 until a step's loss is not finite.
  metrics: list


class EvalState(NamedTuple):
  # float64: a float32 count is exact only up to 2**24 examples.
  loss: tf.Tensor
  examples: tf.Tensor
  metrics: list


class LoopWire:
  """Packs a replica's loop state into one vector, and unpacks the
  reduced vector on the host."""

  def __init__(self, *, metrics, steps_per_loop):
    self._metrics = metrics  # compiled_loops.Metrics
    self._steps_per_loop = steps_per_loop

  @staticmethod
  def _pack_metrics(states, dtype=tf.float32):
    return [tf.reshape(tf.cast(v, dtype), [-1])
            for state in states for v in state]

  @_PLAIN
  def pack_train(self, state, stop=0.0):
    # The first bad step as a one-hot, so a SUM over replicas keeps it.
    bad = tf.where(state.first_nonfinite < 0, self._steps_per_loop,
                   state.first_nonfinite)
    return tf.concat([tf.reshape(state.loss, [1]),
                      tf.one_hot(bad, self._steps_per_loop + 1),
                      tf.reshape(tf.cast(stop, tf.float32), [1]),
                      *self._pack_metrics(state.metrics)], 0)

  @_PLAIN
  def pack_eval(self, state, stop=0.0):
    return tf.concat([tf.reshape(state.loss, [1]),
                      tf.reshape(state.examples, [1]),
                      tf.reshape(tf.cast(stop, tf.float64), [1]),
                      *self._pack_metrics(state.metrics, tf.float64)], 0)

  def _unpack_metrics(self, vector):
    states, offset = [], 0
    for initial in self._metrics.initial:
      state = []
      for value in initial:
        size = value.size
        state.append(vector[offset:offset + size].reshape(value.shape)
                     .astype(value.dtype))
        offset += size
      states.append(state)
    return states

  def unpack_train(self, vector, num_steps) -> LoopSums:
    vector = np.asarray(vector, np.float64)
    bad = np.flatnonzero(vector[1:1 + self._steps_per_loop])
    stop_slot = 2 + self._steps_per_loop
    return LoopSums(
        steps=num_steps, loss_sum=float(vector[0]),
        first_nonfinite=int(bad[0]) if bad.size else None,
        stop=bool(vector[stop_slot] > 0),
        metric_states=self._unpack_metrics(vector[stop_slot + 1:-1]),
        input_wait=float(vector[-1]))

  def unpack_eval(self, vector, num_steps) -> LoopSums:
    vector = np.asarray(vector, np.float64)
    return LoopSums(steps=num_steps, loss_sum=float(vector[0]),
                    examples=float(vector[1]), stop=bool(vector[2] > 0),
                    metric_states=self._unpack_metrics(vector[3:]))
