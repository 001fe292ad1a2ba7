"""Tensors laid end to end in one flat vector, and split back: the layout
that the packed all-reduce (compression), the sharded update and its
checkpoints (sharded_optimizer) share."""

import math

import numpy as np
import tensorflow as tf


class FlatLayout:
  """The flat layout of tensors of `shapes`, in order."""

  def __init__(self, shapes):
    self.shapes = [tuple(shape) for shape in shapes]
    self.sizes = [math.prod(shape) for shape in self.shapes]
    self.size = sum(self.sizes)

  def flatten(self, tensors, dtype=None):
    """One vector (cast to `dtype` when given)."""
    return tf.concat([tf.reshape(t if dtype is None else tf.cast(t, dtype),
                                 [-1]) for t in tensors], axis=0)

  def unflatten(self, flat, dtypes=None):
    """The tensors again (cast back to `dtypes` when given)."""
    pieces = [tf.reshape(piece, shape) for piece, shape in
              zip(tf.split(flat, self.sizes), self.shapes)]
    if dtypes is None:
      return pieces
    return [tf.cast(piece, dtype) for piece, dtype in zip(pieces, dtypes)]

  def flatten_numpy(self, arrays):
    return np.concatenate([np.asarray(a).reshape(-1) for a in arrays])

  def unflatten_numpy(self, flat):
    ends = np.cumsum(self.sizes)[:-1]
    return [piece.reshape(shape) for piece, shape in
            zip(np.split(flat, ends), self.shapes)]
