"""A restore of whole checkpoint entries that reads only what a
process's shards hold (tfdist.params_checkpoint).

At a restore, a sharded entry asks TF for one box of the whole tensor:
the smallest that holds this process's elements of it (a slice spec:
TF's RestoreV2 reads the whole tensor, copies the box out and frees it,
an entry at a time). So the process never holds the whole training
state, only its own elements and, per entry, up to two rows of the
first dimension its range spans beyond them. TF gives one box per entry
to a trackable's restore; a value shared from the chief is whole.
"""

import numpy as np
import tensorflow as tf


def spec(shape, box):
  """TF's slice spec of `box` (begins, sizes) of a tensor of `shape`."""
  return " ".join(str(d) for d in shape) + " " + ":".join(
      f"{b},{s}" for b, s in zip(*box))


def request(shape, dtype, box):
  """What an entry of `shape` serializes to at a restore: {slice spec:
  placeholder} (TF reads the spec, dtype and device, not the value). A
  scalar is read whole; with no `box` (no element of it held here), its
  first element."""
  if not shape or not all(shape):  # A scalar, or no element at all.
    return tf.zeros(shape, dtype)
  box = box or ((0,) * len(shape), (1,) * len(shape))
  return {spec(shape, box): tf.zeros([], dtype)}


def box_of(value, origin, box):
  """`box` (begins, sizes) of an entry, flat, as numpy, from `value`:
  the entry's box at `origin` (its begins; zeros when it is whole)."""
  begins, sizes = box
  index = tuple(slice(b - o, b - o + s)
                for b, o, s in zip(begins, origin, sizes))
  return np.asarray(value, np.float32)[index].reshape(-1)
