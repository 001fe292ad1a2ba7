"""--input_sharding: `file` reads 1/N of the bytes per host (counted by the
kernel, /proc/self/io), covers each example once per epoch over the hosts,
and resumes without repeating; `batch` reads everything on every host."""

import collections
import glob
import os

import numpy as np
import pytest
import tensorflow as tf

from tfdist import config as config_lib
from tfdist import data
from tfdist.errors import ConfigError

HOSTS = 4
GLOBAL_BATCH = 64


@pytest.fixture(scope="module")
def digits(data_dir):
  return data.load(config_lib.Config(model_dir="unused", data_dir=data_dir))


def _bytes_read():
  with open("/proc/self/io") as io:
    return int(dict(line.split(": ") for line in io.read().splitlines())
               ["rchar"])


def _host_pipeline(dataset, host, sharding, start_step=0):
  context = tf.distribute.InputContext(
      num_input_pipelines=HOSTS, input_pipeline_id=host,
      num_replicas_in_sync=HOSTS)
  return data.train_input_fn(dataset, global_batch_size=GLOBAL_BATCH, seed=1,
                             start_step=start_step,
                             sharding=sharding)(context)


def _rows(batches):
  images, labels = batches
  return [(image.tobytes(), int(label))
          for image, label in zip(images.numpy(), labels.numpy())]


def _first_examples(dataset, host, sharding, count, start_step=0):
  stream = _host_pipeline(dataset, host, sharding, start_step).unbatch()
  return _rows(next(iter(stream.batch(count))))


def test_file_sharding_reads_a_quarter_of_the_bytes_per_host(digits,
                                                             data_dir):
  files = glob.glob(os.path.join(data_dir, "digits", "*",
                                 "digits-train.tfrecord-*"))
  total = sum(os.path.getsize(f) for f in files)
  assert len(files) == HOSTS
  next(iter(_host_pipeline(digits, 0, "batch")))  # Warm up: imports, caches.
  read = {}
  for sharding in ("batch", "file"):
    for host in range(HOSTS):
      before = _bytes_read()
      # The first batch fills the shuffle buffer: the host's whole epoch.
      next(iter(_host_pipeline(digits, host, sharding)))
      read[sharding, host] = _bytes_read() - before
  print({k: round(v / total, 3) for k, v in read.items()})
  for host in range(HOSTS):
    assert 0.95 * total <= read["batch", host] <= 1.15 * total, read
    assert 0.2 * total <= read["file", host] <= 0.3 * total, read


def test_file_sharding_trains_each_example_at_most_once_per_epoch(digits):
  """Hosts hold 359 or 360 examples: every host's epoch is the shortest
  host's, so hosts stay in step (a longer epoch on one host would
  sample the other hosts' examples more often)."""
  everything = collections.Counter(_rows(next(iter(
      digits.train_source().batch(10**6)))))
  sizes = [digits.train_files(HOSTS, host)[1] for host in range(HOSTS)]
  assert min(sizes) < max(sizes)
  epoch = min(sizes)
  seen, left_out = collections.Counter(), set()
  for host in range(HOSTS):
    rows = _first_examples(digits, host, "file", 2 * epoch)
    assert len(set(rows[epoch:])) == epoch  # The second epoch, whole.
    seen.update(rows[:epoch])
    left_out |= {row for row in rows[epoch:]} - set(rows[:epoch])
  assert max(seen.values()) == 1 and set(seen) <= set(everything)
  assert sum(seen.values()) == HOSTS * epoch
  # The second epoch leaves out other examples than the first.
  assert left_out and left_out <= set(everything) - set(seen)


def test_file_sharding_resumes_where_it_stopped(digits):
  per_host = GLOBAL_BATCH // HOSTS
  start = 7  # Steps already trained.
  whole = _first_examples(digits, 2, "file", 20 * per_host)
  resumed = _first_examples(digits, 2, "file", 13 * per_host,
                            start_step=start)
  assert resumed == whole[start * per_host:]
  # Another host reads other examples.
  assert set(_first_examples(digits, 1, "file", 20 * per_host)).isdisjoint(
      whole)


def test_file_stream_says_it_never_ends(digits):
  assert _host_pipeline(digits, 1, "file").cardinality() == (
      tf.data.INFINITE_CARDINALITY)


def test_auto_and_bad_requests(digits):
  synthetic = data.load(config_lib.Config(model_dir="unused",
                                          dataset="synthetic"))
  # auto: by file only when the data is streamed (digits is cached).
  assert data.resolve_sharding(digits, "auto", 4, seed=0) == "batch"
  assert data.resolve_sharding(digits, "auto", 4, seed=0,
                               streamed=True) == "file"
  assert data.resolve_sharding(digits, "auto", 5, seed=0,
                               streamed=True) == "batch"
  assert data.resolve_sharding(synthetic, "auto", 2, seed=0) == "batch"
  with pytest.raises(ConfigError, match=r"has 4 train file\(s\).*"
                     r"Received: input_sharding=file with 5 hosts"):
    data.resolve_sharding(digits, "file", 5, seed=0)
  with pytest.raises(ConfigError, match="synthetic has 0 train file"):
    data.resolve_sharding(synthetic, "file", 2, seed=0)
  # One host: file mode is the batch mode, example for example.
  assert np.array_equal(
      *(next(iter(data.train_input_fn(
          digits, global_batch_size=8, seed=3, sharding=mode)(
              tf.distribute.InputContext())))[0].numpy()
        for mode in ("batch", "file")))
