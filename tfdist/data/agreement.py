"""Multi-worker runs: every worker must see the same files.

Each worker globs and counts on its own, and the order of an epoch is
arithmetic in the files and their counts. With a local disk per host, or
shards still being written, two workers would deal different files and
drop or double some with no error. So the workers compare a digest of
(path, records) before the first step, and all stop in one line if any
differs.
"""

import hashlib
import json

import tensorflow as tf

from tfdist.errors import ConfigError

_CHUNKS = 3  # 16-bit pieces of the digest: 48 bits compared.


def digest(record_counts):
  """48 bits of (path, records) over both splits' files."""
  listed = sorted((path, entry[2]) for path, entry in record_counts.items())
  value = hashlib.sha256(json.dumps(listed).encode()).digest()
  return [int.from_bytes(value[2 * i:2 * i + 2], "big")
          for i in range(_CHUNKS)]


def _all_equal(strategy, pieces):
  """Whether every replica holds `pieces`: the sums of x and x^2 over R
  replicas are R x and R x^2 only when every x is the same (float64
  keeps them exact)."""
  local = tf.constant(pieces + [p * p for p in pieces], tf.float64)

  @tf.function
  def summed():
    return strategy.reduce(tf.distribute.ReduceOp.SUM,
                           strategy.run(lambda: tf.identity(local)),
                           axis=None)
  replicas = strategy.num_replicas_in_sync
  return [int(v) for v in summed().numpy()] == [replicas * int(v)
                                                for v in local.numpy()]


def check_same_files(strategy, record_counts, task_name):
  """Raises ConfigError on every worker unless all see the same files."""
  pieces = digest(record_counts)
  if _all_equal(strategy, pieces):
    return
  records = sum(entry[2] for entry in record_counts.values())
  raise ConfigError(
      f"the workers do not see the same data files: {task_name} sees "
      f"{len(record_counts)} file(s) of {records} records (digest "
      f"{''.join(f'{p:04x}' for p in pieces)}), another worker sees others. "
      "Every worker must see the same files, whole (a shared filesystem, "
      "or the same copy on every host, not still being written).")
