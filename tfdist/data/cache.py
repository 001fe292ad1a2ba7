"""What is cached: --cache=auto|memory|off|PATH.

Data in memory (arrays) is always cached: that costs nothing. Data read
from files is cached by `memory` or into files at PATH (one per host and
split), and streamed by `off`. `auto` caches it in memory only when what
the cache would hold, the parsed examples (decoded images are many times
their compressed files), takes at most AUTO_CACHE_BYTES, so that nothing
is cached unless it fits. Augmentation runs after the cache either way.
"""

import dataclasses
import hashlib
import json
import os
import socket

from absl import logging
import numpy as np
import tensorflow as tf

from tfdist import storage
from tfdist.errors import ConfigError

AUTO_CACHE_BYTES = 64 << 20


def example_bytes(example):
  """Bytes one parsed example takes in a cache (strings: their length)."""
  total = 0
  # Sparse and ragged tensors: their values, indices and row splits.
  for tensor in tf.nest.flatten(example, expand_composites=True):
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
  (JSON-able: what data they hold) is hashed into their name, so that a
  cache of other data is never read back, nor removed."""
  if mode == "off":
    return source
  if mode == "memory":
    return lambda: source().cache()
  digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
  prefix = f"{mode}-{name}-{digest.hexdigest()[:10]}"

  def from_files():
    _prepare(prefix)
    return source().cache(prefix)
  return from_files


def identity(dataset, split):
  """What a cache file of `split` holds: the data's name, size, the
  split's files and record counts, and the parse (its name and code)."""
  files = dataset.file_split if split == "train" else dataset.eval_split
  parse = getattr(files, "parse", None)
  code = getattr(parse, "__code__", None)
  return {"data": dataset.name, "split": split,
          "examples": (dataset.num_train_examples if split == "train"
                       else dataset.num_test_examples),
          "files": hashlib.sha256(json.dumps(
              sorted(zip(files.paths, files.counts))).encode()).hexdigest()
                   if files else None,
          "parse": [getattr(parse, "__qualname__", repr(type(parse))),
                    hashlib.sha256(code.co_code).hexdigest() if code
                    else None]}


def _prepare(prefix):
  """Before TF's file cache at `prefix` is written: a first pass cut
  short (TF's lockfile and partial shards, which TF takes for a
  concurrent writer) is removed when its writer, named in
  `prefix.tfdist.json`, is a process of this host that is gone; one
  still running, or on another host, is one error line."""
  if tf.io.gfile.exists(prefix + ".index"):
    return  # Complete; its name says what it holds.
  mark = prefix + ".tfdist.json"
  leftovers = [*tf.io.gfile.glob(prefix + "_[0-9]*.lockfile"),
               *tf.io.gfile.glob(prefix + "_[0-9]*")]
  if leftovers:
    writer = storage.read_json(mark) or {}
    if not _gone(writer):
      raise ConfigError(
          f"the cache at {prefix}* is being written by "
          f"{writer.get('host')} (pid {writer.get('pid')}), or was left by "
          "it: if no run writes it, remove those files; or give another "
          "--cache.")
    logging.warning("The cache at %s* was cut short before it was "
                    "complete (a preemption?): it is written again.", prefix)
    for path in set(leftovers):
      if tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)
  storage.write_text(mark, json.dumps({"host": socket.gethostname(),
                                       "pid": os.getpid()}))


def _gone(writer):
  """Whether the process that wrote a cache's mark is no more: one of
  this host's that has ended, or no mark (an older tfdist's cache)."""
  if not writer:
    return True
  if writer.get("host") != socket.gethostname():
    return False
  pid = writer.get("pid")
  if pid == os.getpid():
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except (PermissionError, TypeError, OverflowError):
    return False
  return False


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
