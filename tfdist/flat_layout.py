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


def boxes(shape, start, end):
  """Elements [start, end) of a row-major array of `shape` (flat
  indices), as boxes in their order: [(begins, sizes)], one of each per
  dimension. A range is a partial first row, whole rows and a partial
  last row, each partial row a range of the dimensions below."""
  if start >= end:
    return []
  if not shape:
    return [((), ())]
  row = math.prod(shape[1:])

  def in_row(index, low, high):
    return [((index,) + b, (1,) + s)
            for b, s in boxes(shape[1:], low, high)]

  first, last = start // row, (end - 1) // row
  if first == last:
    return in_row(first, start - first * row, end - first * row)
  found, whole_from = [], first
  if start % row:
    found += in_row(first, start % row, row)
    whole_from += 1
  whole_to = last if end % row else last + 1
  if whole_to > whole_from:
    found.append(((whole_from,) + (0,) * (len(shape) - 1),
                  (whole_to - whole_from,) + tuple(shape[1:])))
  if end % row:
    found += in_row(last, 0, end % row)
  return found


def bounding_box(shape, start, end):
  """The smallest box (begins, sizes) of a row-major array of `shape`
  that holds its flat elements [start, end) (start < end): the indices
  both ends share, then the range of the first that differs, then all."""
  begins, sizes = [], []
  for d, size in enumerate(shape):
    row = math.prod(shape[d + 1:])
    first, last = start // row, (end - 1) // row
    begins.append(first)
    sizes.append(last - first + 1)
    if first != last:
      return (tuple(begins) + (0,) * (len(shape) - d - 1),
              tuple(sizes) + tuple(shape[d + 1:]))
    start, end = start - first * row, end - first * row
  return tuple(begins), tuple(sizes)


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

  def boxes(self, start, end):
    """Elements [start, end) of flatten()'s vector, as [(tensor index,
    begins, sizes)] in their order (see `boxes`)."""
    found, offset = [], 0
    for i, (shape, count) in enumerate(zip(self.shapes, self.sizes)):
      low, high = max(start, offset), min(end, offset + count)
      found += [(i, b, s) for b, s in boxes(shape, low - offset,
                                            high - offset)]
      offset += count
    return found

  def flatten_numpy(self, arrays):
    return np.concatenate([np.asarray(a).reshape(-1) for a in arrays])

  def unflatten_numpy(self, flat):
    ends = np.cumsum(self.sizes)[:-1]
    return [piece.reshape(shape) for piece, shape in
            zip(np.split(flat, ends), self.shapes)]
