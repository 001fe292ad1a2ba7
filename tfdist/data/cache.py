"""What is cached: --cache=auto|memory|off|PATH.

Data in memory (arrays) is always cached: that costs nothing. Data read
from files is cached by `memory` or into files at PATH (one per host and
split), and streamed by `off`. `auto` caches it in memory only when what
the cache would hold, the parsed examples (decoded images are many times
their compressed files), takes at most AUTO_CACHE_BYTES, so that nothing
is cached unless it fits. Augmentation runs after the cache either way.
"""

import numpy as np
import tensorflow as tf

AUTO_CACHE_BYTES = 64 << 20


def example_bytes(example):
  """Bytes one parsed example takes in a cache (strings: their length)."""
  total = 0
  for tensor in tf.nest.flatten(example):
    value = np.asarray(tensor.numpy() if hasattr(tensor, "numpy")
                       else tensor)
    if value.dtype == object:
      total += sum(len(v) for v in value.ravel()) + 8 * value.size
    else:
      total += value.nbytes
  return total


def spec_bytes(spec):
  """Bytes of one example of `spec` when every shape is known and nothing
  is a string; None otherwise."""
  total = 0
  for one in tf.nest.flatten(spec):
    if not (isinstance(one, tf.TensorSpec) and one.shape.is_fully_defined()
            and one.dtype != tf.string):
      return None
    total += one.shape.num_elements() * one.dtype.size
  return total


def resolve(choice, dataset):
  """`memory`, `off` or a path prefix, for a Dataset not in memory."""
  if choice != "auto":
    return choice
  size = _weighed(dataset)
  return "memory" if size is not None and size <= AUTO_CACHE_BYTES else "off"


def _weighed(dataset):
  """What a cache of the train split would hold: its parsed examples when
  known, else its bytes on disk."""
  if dataset.cache_bytes is not None:
    return dataset.cache_bytes
  return dataset.train_bytes


def cached(source, mode, name):
  """`source` (a function returning a tf.data.Dataset) with the cache
  `mode`; `name` tells apart the files of a PATH cache."""
  if mode == "off":
    return source
  if mode == "memory":
    return lambda: source().cache()
  return lambda: source().cache(f"{mode}-{name}")


def host_name(split, host, hosts):
  """A split's cache name on one host: hosts never share a cache file
  (TF refuses a second writer)."""
  return f"{split}-{host}-of-{hosts}"


def describe(mode, dataset):
  parsed = dataset.cache_bytes
  parsed = f", about {parsed / 2**20:.0f} MiB parsed" if parsed else ""
  if mode == "memory":
    return f"cached in memory{parsed}"
  if mode == "off":
    size = dataset.train_bytes
    return ("streamed from its files, not cached"
            + (f" ({size / 2**20:.0f} MiB on disk{parsed})" if size else ""))
  return f"cached in files at {mode}-*{parsed}"
