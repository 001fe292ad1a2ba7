"""Tensors laid end to end in one flat vector, and split back: the layout
that the packed all-reduce (compression), the sharded update and its
checkpoints (sharded_optimizer) share."""

import math

import numpy as np
import tensorflow as tf


def read_range(tensors, sizes, start, end):
  """Elements [start, end) of the concatenation of `tensors` (of `sizes`
  elements each, flattened), zeros past its end, read from the tensors
  that overlap the range only."""
  pieces, offset = [], 0
  for tensor, count in zip(tensors, sizes):
    low, high = max(start, offset), min(end, offset + count)
    if low < high:
      pieces.append(tf.reshape(tensor, [-1])[low - offset:high - offset])
    offset += count
  covered = max(min(end, offset) - start, 0)
  if covered < end - start:
    pieces.append(tf.zeros([end - start - covered], tensors[0].dtype))
  return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)


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

  def read(self, tensors, start, end):
    """Elements [start, end) of flatten(tensors), zeros past its end."""
    return read_range(tensors, self.sizes, start, end)

  def unflatten_pieces(self, pieces, piece_size):
    """The tensors again from `pieces`: flatten()'s vector cut into
    consecutive pieces of `piece_size` elements (the last padded), each
    tensor read from the pieces it overlaps only."""
    sizes = [piece_size] * len(pieces)
    tensors, offset = [], 0
    for count, shape in zip(self.sizes, self.shapes):
      tensors.append(tf.reshape(
          read_range(pieces, sizes, offset, offset + count), shape))
      offset += count
    return tensors

  def flatten_numpy(self, arrays):
    return np.concatenate([np.asarray(a).reshape(-1) for a in arrays])

  def unflatten_numpy(self, flat):
    ends = np.cumsum(self.sizes)[:-1]
    return [piece.reshape(shape) for piece, shape in
            zip(np.split(flat, ends), self.shapes)]
