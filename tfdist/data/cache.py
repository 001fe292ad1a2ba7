"""What is cached: --cache=auto|memory|off|PATH.

Data in memory (arrays) is always cached: that costs nothing. Data read
from files is cached by `memory` or into files at PATH (one per host and
split), and streamed by `off`. `auto` caches it in memory only when its
files take at most AUTO_CACHE_BYTES, so that nothing is cached unless it
fits. Augmentation runs after the cache either way.
"""

AUTO_CACHE_BYTES = 64 << 20


def resolve(choice, dataset):
  """`memory`, `off` or a path prefix, for a Dataset not in memory."""
  if choice != "auto":
    return choice
  small = dataset.train_bytes is not None and (
      dataset.train_bytes <= AUTO_CACHE_BYTES)
  return "memory" if small else "off"


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
  if mode == "memory":
    return "cached in memory"
  if mode == "off":
    size = dataset.train_bytes
    return ("streamed from its files, not cached"
            + (f" ({size / 2**20:.0f} MiB)" if size else ""))
  return f"cached in files at {mode}-*"
