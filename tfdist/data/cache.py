"""What is cached: --cache=auto|memory|off|PATH.

Data in memory (arrays) is always cached: that costs nothing. Data read
from files is cached by `memory` or into files at PATH (one per host and
split), and streamed by `off`. `auto` caches it in memory only when what
the cache would hold, the parsed examples (decoded images are many times
their compressed files), takes at most AUTO_CACHE_BYTES, so that nothing
is cached unless it fits. Augmentation runs after the cache either way.
"""

import dataclasses
import json

from absl import logging
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


def cached(source, mode, name, identity=None):
  """`source` (a function returning a tf.data.Dataset) with the cache
  `mode`; `name` tells apart the files of a PATH cache, and `identity`
  (JSON-able) says what data they hold."""
  if mode == "off":
    return source
  if mode == "memory":
    return lambda: source().cache()
  prefix = f"{mode}-{name}"

  def from_files():
    _prepare(prefix, identity)
    return source().cache(prefix)
  return from_files


def identity(dataset, split):
  """What a cache file of `split` holds: the data's name, size, files and
  parse, so that a cache of other data is not read back."""
  files = dataset.file_split
  parse = getattr(files, "parse", None)
  return {"data": dataset.name, "split": split,
          "examples": (dataset.num_train_examples if split == "train"
                       else dataset.num_test_examples),
          "files": sorted(zip(files.paths, files.counts)) if files else None,
          "parse": getattr(parse, "__qualname__", None)}


def _prepare(prefix, held):
  """Before TF's file cache at `prefix` is used: a cache of other data is
  removed (its `.tfdist.json` names what it holds), and so is a first pass
  cut short (its lockfile and partial shards, which TF takes for a
  concurrent writer). Each host owns its own prefix."""
  mark = prefix + ".tfdist.json"
  wanted = json.dumps(held, sort_keys=True)
  if tf.io.gfile.exists(prefix + ".index"):
    if _read(mark) == wanted:
      return
    logging.warning("The cache at %s* holds other data than %s: it is "
                    "written again.", prefix, held.get("data") if held
                    else "this run's")
    stale = [prefix + ".index", mark, *tf.io.gfile.glob(prefix + ".data-*")]
  else:
    stale = [*tf.io.gfile.glob(prefix + ".lockfile"),
             *tf.io.gfile.glob(prefix + "_[0-9]*")]
    if stale:
      logging.warning("The cache at %s* was cut short before it was "
                      "complete (a preemption?): it is written again.",
                      prefix)
  for path in stale:
    if tf.io.gfile.exists(path):
      tf.io.gfile.remove(path)
  with tf.io.gfile.GFile(mark, "w") as out:
    out.write(wanted)


def _read(path):
  if not tf.io.gfile.exists(path):
    return None
  with tf.io.gfile.GFile(path) as lines:
    return lines.read()


@dataclasses.dataclass(frozen=True)
class Policy:
  """How a run reads its train split: the cache mode and whether the
  split is streamed in a planned order."""

  cache: str
  planned: bool

  @classmethod
  def of(cls, dataset, cache):
    if dataset.in_memory:
      return cls("memory", False)
    mode = resolve(cache, dataset)
    if dataset.num_train_examples is None:
      mode = "off"  # Unknown size: cannot be cached whole before use.
    return cls(mode, mode == "off" and dataset.file_split is not None)

  def source(self, dataset, source, name):
    if dataset.in_memory:
      return source
    return cached(source, self.cache, name, identity(
        dataset, name.split("-")[0]))


def host_name(split, host, hosts):
  """A split's cache name on one host: hosts never share a cache file
  (TF refuses a second writer)."""
  return f"{split}-{host}-of-{hosts}"


def _mib(size):
  return f"{size / 2**20:.1f} MiB" if size < 10 << 20 else (
      f"{size / 2**20:.0f} MiB")


def describe(mode, dataset):
  parsed = dataset.cache_bytes
  parsed = f", about {_mib(parsed)} parsed" if parsed else ""
  if mode == "memory":
    return f"cached in memory{parsed}"
  if mode == "off":
    size = dataset.train_bytes
    return ("streamed from its files, not cached"
            + (f" ({_mib(size)} on disk{parsed})" if size else ""))
  return f"cached in files at {mode}-*{parsed}"
