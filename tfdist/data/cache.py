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
import inspect
import json
import os
import socket
import time

from absl import logging
import numpy as np
import tensorflow as tf

from tfdist import storage
from tfdist.errors import ConfigError

AUTO_CACHE_BYTES = 64 << 20
# A cache cut short on another host is taken for dead when none of its
# files changed for this long.
STALE_SECONDS = 3600


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
  """What a cache file of `split` holds: the data's name and size, the
  split's files (records, bytes, modification times) and the parse (its
  source, bytecode, constants and names; not the functions it calls)."""
  files = dataset.file_split if split == "train" else dataset.eval_split
  kept = dataset.record_counts or {}
  return {"data": dataset.name, "split": split,
          "examples": (dataset.num_train_examples if split == "train"
                       else dataset.num_test_examples),
          "files": _digest(sorted(
              (path, kept.get(path, [None, None, count])[:3])
              for path, count in zip(files.paths, files.counts)))
                   if files else None,
          "parse": _code_digest(files.parse) if files else None}


def _digest(value):
  return hashlib.sha256(repr(value).encode()).hexdigest()


def _code_digest(function):
  """A function's source, bytecode, constants and names (and a partial's
  arguments): a parse edited in place is other data."""
  target = getattr(function, "func", function)  # functools.partial
  parts = [getattr(target, "__qualname__", type(target).__qualname__),
           repr(getattr(function, "args", ())),
           repr(getattr(function, "keywords", {}))]
  try:
    parts.append(inspect.getsource(target))
  except (OSError, TypeError):
    pass
  code = getattr(target, "__code__", None)
  if code is not None:
    parts += [code.co_code.hex(), repr(code.co_names), repr(
        [c for c in code.co_consts if not inspect.iscode(c)])]
  return _digest(parts)


def _prepare(prefix):
  """Before TF's file cache at `prefix` is written: a first pass cut
  short (TF's `prefix_N.lockfile` and partial shards, which TF takes for
  a concurrent writer) is removed when its writer, named in
  `prefix.tfdist.json`, is gone (see _gone); otherwise one error line."""
  if tf.io.gfile.exists(prefix + ".index"):
    return  # Complete; its name says what it holds.
  mark = prefix + ".tfdist.json"
  leftovers = tf.io.gfile.glob(prefix + "_[0-9]*")  # Lockfile included.
  if leftovers:
    writer = storage.read_json(mark) or {}
    if not _gone(writer, leftovers):
      raise ConfigError(
          f"the cache at {prefix}* is being written by "
          f"{writer.get('host')} (pid {writer.get('pid')}), or was left by "
          "it: if no run writes it, remove those files; or give another "
          "--cache.")
    logging.warning("The cache at %s* was cut short before it was "
                    "complete (a preemption?): it is written again.", prefix)
    for path in leftovers:
      if tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)
  storage.write_text(mark, json.dumps(_this_process()))


def _this_process():
  return {"host": socket.gethostname(), "pid": os.getpid(),
          "boot": _boot_id(), "start": _started(os.getpid())}


def _gone(writer, leftovers):
  """Whether the process that wrote a cache's mark is no more: no mark
  (an older tfdist's); on this host (same boot), a process that has
  ended or whose pid another one took (a container restarted in its pod
  starts as the same pid); on another host, files untouched for
  STALE_SECONDS (a writer appends as it goes)."""
  if not writer:
    return True
  if writer.get("host") == socket.gethostname() and writer.get("boot") == (
      _boot_id()):
    pid = writer.get("pid")
    return not isinstance(pid, int) or _started(pid) != writer.get("start")
  newest = max(tf.io.gfile.stat(path).mtime_nsec for path in leftovers)
  return time.time() - newest / 1e9 > STALE_SECONDS


def _boot_id():
  try:
    with open("/proc/sys/kernel/random/boot_id") as boot:
      return boot.read().strip()
  except OSError:
    return None


def _started(pid):
  """A process's start (clock ticks after boot), or None when there is
  no such process (or no /proc)."""
  try:
    with open(f"/proc/{pid}/stat") as stat:
      return int(stat.read().rsplit(")", 1)[1].split()[19])
  except (OSError, IndexError, ValueError):
    return None


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
