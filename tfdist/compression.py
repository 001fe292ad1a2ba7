"""The gradient all-reduce, in float32 or compressed to float16/bfloat16.

A Keras 3 optimizer all-reduces gradients itself under a strategy
(`_all_reduce_sum_gradients`). Casting before that adds a second reduction
(we measured 1.5x the float32 bytes, not 0.5x), and clipping before it
clips each replica's gradients differently. So the train step reduces the
gradients itself (here) and the optimizer's own reduction is switched off.
"""

import tensorflow as tf

SUM = tf.distribute.ReduceOp.SUM


def _already_reduced(grads_and_vars):
  return list(grads_and_vars)


def take_over_reduction(optimizer):
  """Makes `optimizer` apply gradients as given (in place): the caller has
  all-reduced them with `all_reduce`."""
  target = getattr(optimizer, "inner_optimizer", optimizer)
  if not hasattr(target, "_all_reduce_sum_gradients"):
    raise RuntimeError(
        "This Keras version has no _all_reduce_sum_gradients hook; tfdist "
        "cannot take over its gradient all-reduce.")
  target._all_reduce_sum_gradients = _already_reduced  # pylint: disable=protected-access
  return optimizer


def all_reduce(grads, dtype="float32"):
  """Sums `grads` over the replicas in sync, sent in `dtype`. Call in a
  replica context; None gradients stay None."""
  context = tf.distribute.get_replica_context()
  present = [i for i, g in enumerate(grads) if g is not None]
  if context is None or context.num_replicas_in_sync == 1 or not present:
    return list(grads)
  wire = tf.as_dtype(dtype)
  sent = [grads[i] for i in present]
  if wire != tf.float32:
    sent = [tf.cast(g, wire) for g in sent]
  reduced = context.all_reduce(SUM, sent)
  result = list(grads)
  for i, total in zip(present, reduced):
    result[i] = tf.cast(total, grads[i].dtype) if wire != tf.float32 else total
  return result
