"""tfdist.FileData, in one process: records counted from the headers (local
and ram://), the planned order (each id once per epoch over the hosts, a
new order each epoch, a resume equal to the tail of the uninterrupted
stream), bytes per host, augmentation drawn anew each epoch, and what a
user's own file pipeline gets."""

import collections
import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf

from tfdist import data
from tfdist.data import cache as cache_lib
from tfdist.data import counts as counts_lib
from tfdist.data import files as files_lib
from tfdist.data import order
from tfdist.errors import ConfigError

# Unequal files, one empty, more than one round of order.CYCLE.
COUNTS = [37, 50, 12, 64, 0, 23, 41, 55, 30, 18, 9]
TOTAL = sum(COUNTS)


def _example(i, width):
  feature = {"id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
             "pad": tf.train.Feature(bytes_list=tf.train.BytesList(
                 value=[b"x" * width]))}
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString()


def _write(root, counts, width=0, prefix="train"):
  start = 0
  for f, count in enumerate(counts):
    with tf.io.TFRecordWriter(f"{root}/{prefix}-{f:03d}.tfrecord") as out:
      for i in range(start, start + count):
        out.write(_example(i, width))
    start += count


def _parse(record):
  example = tf.io.parse_single_example(
      record, {"id": tf.io.FixedLenFeature([], tf.int64)})
  features = tf.cast(example["id"], tf.float32)[None]
  return features, example["id"]


def _file_data(root, **kwargs):
  return data.FileData(train=f"{root}/train-*", eval=f"{root}/eval-*",
                       parse=_parse, **kwargs)


def write_split_files(tmp_path_factory, counts):
  """Train files of `counts` records and eval files of 7 and 5."""
  path = str(tmp_path_factory.mktemp("files"))
  _write(path, counts)
  _write(path, [7, 5], prefix="eval")
  return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  return write_split_files(tmp_path_factory, COUNTS)


@pytest.fixture(scope="module")
def dataset(root):
  return data.file_dataset(_file_data(root, num_classes=2), "files")


def _ids(records, count):
  return [int(i) for i in next(iter(records.take(count).map(
      lambda r: _parse(r)[1]).batch(count)))]


def test_records_are_counted_from_the_headers_locally_and_on_ram(root,
                                                                 dataset):
  split = dataset.file_split
  assert split.counts == tuple(c for c in COUNTS if c)  # The empty one kept out.
  assert len(split.paths) == len(COUNTS) - 1
  assert dataset.num_train_examples == TOTAL and dataset.num_test_examples == 12
  assert not dataset.in_memory and dataset.train_bytes == sum(
      os.path.getsize(p) for p in split.paths)
  _write("ram://tfdist-counts", [3, 0, 4])
  for path, count in zip(sorted(tf.io.gfile.glob("ram://tfdist-counts/*")),
                         [3, 0, 4]):
    assert counts_lib.count_records(path, "") == count


def _records(split, *, position, **kwargs):
  """The stream order.records gives from `position` on."""
  return order.records(split, start=order.place(split, position=position,
                                                **kwargs), **kwargs)


def _epochs(split, hosts, host, seed, epochs, window=16):
  """Each of this pipeline's first `epochs` epochs, as a list of ids."""
  sizes = [order.epoch_length(split.counts, seed, e, hosts)
           for e in range(epochs)]
  stream = _ids(_records(split, seed=seed, hosts=hosts, host=host,
                        position=0, window=window), sum(sizes))
  bounds = np.cumsum([0] + sizes)
  return [stream[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _file_ids(split, files):
  """The ids the kept files `files` hold (ids run on across the files)."""
  starts = np.cumsum([0] + list(split.counts))
  return {i for f in files for i in range(starts[f], starts[f + 1])}


@pytest.mark.parametrize("hosts", [1, 2, 3])
def test_each_epoch_reads_each_id_at_most_once_over_the_hosts(dataset,
                                                              hosts):
  """Unequal files: every host's epoch is as long as the shortest host's,
  so they stay in the same epoch; each host's epoch is from its own files
  of that epoch, and no id repeats within an epoch."""
  split = dataset.file_split
  epochs = [_epochs(split, hosts, host, 5, 3) for host in range(hosts)]
  for e in range(3):
    seen = collections.Counter(i for host in epochs for i in host[e])
    assert max(seen.values()) == 1
    for host in range(hosts):
      assert set(epochs[host][e]) <= _file_ids(split, order.host_files(
          len(split.paths), 5, e, hosts, host))
    if hosts == 1:
      assert seen == collections.Counter(range(TOTAL))
    else:  # What the longer hosts leave out.
      assert 0 < TOTAL - len(seen) < TOTAL // 2
  # The order is new every epoch: a new file order and new windows.
  assert epochs[0][0] != epochs[0][1]
  # Another seed, another order.
  assert _epochs(split, hosts, 0, 6, 1)[0] != epochs[0][0]


@pytest.mark.parametrize("hosts,host", [(1, 0), (2, 1), (3, 2)])
def test_a_resume_is_the_tail_of_the_uninterrupted_stream(dataset, hosts,
                                                          host):
  split = dataset.file_split
  window = 16
  first = order.epoch_length(split.counts, 9, 0, hosts)
  whole = _ids(_records(split, seed=9, hosts=hosts, host=host,
                       position=0, window=window), first + 200)
  for position in sorted({1, window - 1, window, window + 3, 45, 100,
                          first - 1, first, first + 17}):
    resumed = _ids(_records(split, seed=9, hosts=hosts, host=host,
                           position=position, window=window), 150)
    assert resumed == whole[position:position + 150], position


def test_remote_files_are_read_in_parallel_in_the_same_order(dataset):
  """Local files are read one at a time and ram:// (remote, as gs://) in
  parallel: the stream is the same, resumed or not."""
  split = dataset.file_split
  remote_paths = []
  for number, path in enumerate(split.paths):
    remote_paths.append(f"ram://tfdist-parallel/{number:02d}")
    tf.io.gfile.copy(path, remote_paths[-1], overwrite=True)
  remote = dataclasses.replace(split, paths=tuple(remote_paths))
  assert remote.remote and not split.remote
  for position in (0, 37):
    streams = [_ids(_records(s, seed=4, hosts=2, host=1,
                            position=position, window=16), 120)
               for s in (split, remote)]
    assert streams[0] == streams[1]
  # Eval and cache fills read every record in one order wherever the files
  # are: TF's 8-file interleave, in which caches already written hold them.
  everything = split.num_examples
  written = _ids(tf.data.TFRecordDataset(list(split.paths),
                                         num_parallel_reads=8), everything)
  assert [_ids(s.records(), everything) for s in (split, remote)] == [
      written, written]


def _interleaved(counts, skips):
  """Reading files in turn, one record each, as order.interleave does."""
  left = [list(range(s, c)) for c, s in zip(counts, skips)]
  out = []
  while any(left):
    for f, records in enumerate(left):
      if records:
        out.append((f, records.pop(0)))
  return out


def test_resume_round_matches_reading_in_turn():
  rng = np.random.RandomState(0)
  for _ in range(200):
    counts = [int(c) for c in rng.randint(1, 12, size=rng.randint(1, 9))]
    whole = _interleaved(counts, [0] * len(counts))
    consumed = int(rng.randint(0, sum(counts)))
    left = order.resume_round(counts, consumed)
    resumed = _interleaved([counts[f] for f, _ in left],
                           [given for _, given in left])
    assert [(left[f][0], r) for f, r in resumed] == whole[consumed:]


def _host_batches(dataset, hosts, host, steps, start_step=0, **kwargs):
  context = tf.distribute.InputContext(num_input_pipelines=hosts,
                                       input_pipeline_id=host,
                                       num_replicas_in_sync=hosts)
  batches = data.train_input_fn(dataset, global_batch_size=8 * hosts, seed=3,
                                start_step=start_step, **kwargs)(context)
  return [labels.numpy().tolist() for _, labels in batches.take(steps)]


@pytest.mark.parametrize("sharding", ["file", "batch"])
def test_train_input_resumes_at_its_step(dataset, sharding):
  whole = _host_batches(dataset, 2, 1, 60, sharding=sharding, cache="off",
                        shuffle_buffer=20)
  assert _host_batches(dataset, 2, 1, 40, start_step=20, sharding=sharding,
                       cache="off", shuffle_buffer=20) == whole[20:]


def _bytes_read():
  with open("/proc/self/io") as io:
    return int(dict(line.split(": ") for line in io.read().splitlines())
               ["rchar"])


def test_each_of_two_hosts_reads_about_half_of_the_bytes(tmp_path):
  _write(str(tmp_path), [200] * 8, width=2000)
  _write(str(tmp_path), [4], prefix="eval")
  big = data.file_dataset(_file_data(str(tmp_path)), "big")
  total = big.train_bytes
  # Warm up (imports, traces); a small window bounds what is read ahead.
  _host_batches(big, 2, 0, 1, sharding="file", cache="off")
  for host in range(2):
    before = _bytes_read()
    _host_batches(big, 2, host, 100, sharding="file", cache="off",
                  shuffle_buffer=50)  # 100 batches of 8: one host-epoch.
    read = _bytes_read() - before
    assert 0.4 * total <= read <= 0.55 * total, (host, read / total)
  assert big.num_train_examples == 1600


def _noisy(features, label):
  return features + tf.random.uniform([1], 0.0, 0.5), label


@pytest.mark.parametrize("cache", ["off", "memory"])
def test_augmentation_is_drawn_anew_every_epoch(root, cache):
  """An example (known by its id) is augmented differently in its two
  epochs, whether the files are streamed or cached."""
  augmented = data.file_dataset(_file_data(root, augment=_noisy), "noisy")
  context = tf.distribute.InputContext()
  batches = data.train_input_fn(augmented, global_batch_size=TOTAL, seed=1,
                                cache=cache)(context)
  draws = collections.defaultdict(list)
  for features, labels in batches.take(2):
    for value, label in zip(features.numpy()[:, 0], labels.numpy()):
      assert 0 <= value - label < 0.5
      draws[int(label)].append(float(value))
  assert sorted(draws) == list(range(TOTAL))
  assert all(len(d) == 2 and d[0] != d[1] for d in draws.values())


def test_cache_auto_keeps_small_files_in_memory(dataset):
  assert cache_lib.resolve("auto", dataset) == "memory"
  huge = dataclasses.replace(dataset, cache_bytes=1 << 40)
  assert cache_lib.resolve("auto", huge) == "off"
  assert cache_lib.resolve("/tmp/c", huge) == "/tmp/c"


def test_a_users_own_file_pipeline_is_streamed_and_not_counted(root):
  train = tf.data.TFRecordDataset(tf.io.gfile.glob(f"{root}/train-*")).map(
      _parse)
  test = tf.data.TFRecordDataset(tf.io.gfile.glob(f"{root}/eval-*")).map(
      _parse)
  streamed = data.from_user("own", train, test)
  assert not streamed.in_memory and streamed.num_train_examples is None
  assert streamed.num_test_examples == 12  # Exact eval needs its count.
  in_memory = data.from_user("arrays", *(
      tf.data.Dataset.from_tensor_slices((np.zeros((n, 1), np.float32),
                                          np.zeros(n, np.int64)))
      for n in (30, 6)))
  assert in_memory.in_memory and in_memory.num_train_examples == 30


def test_bad_file_data_names_the_argument(root, tmp_path):
  with pytest.raises(ConfigError, match=r"train takes a file pattern.*"
                     r"Received: train=\[\]"):
    data.FileData(train=[], eval="x", parse=_parse)
  with pytest.raises(ConfigError, match="parse must be a function"):
    data.FileData(train="x", eval="x", parse=None)
  with pytest.raises(ConfigError, match="compression must be one of"):
    data.FileData(train="x", eval="x", parse=_parse, compression="zip")
  with pytest.raises(ConfigError, match="no train file matches"):
    data.file_dataset(_file_data(str(tmp_path)), "none")
  (tmp_path / "train-0").write_bytes(b"not a tfrecord at all, no")
  (tmp_path / "eval-0").write_bytes(b"")
  with pytest.raises(ConfigError, match="cannot read .*train-0 as TFRecords"):
    data.file_dataset(_file_data(str(tmp_path)), "garbage")


def test_a_changed_plan_is_named_and_the_same_plan_is_silent():
  plan = {"sharding": "file", "input_pipelines": 2, "train_examples": 512,
          "train_files": 8, "shuffle_buffer": 10000}
  assert data.describe_plan_change(plan, dict(plan), 40) is None
  assert data.describe_plan_change(None, plan, 40) is None
  message = data.describe_plan_change(
      plan, {**plan, "sharding": "batch", "input_pipelines": 1}, 40)
  assert message.startswith("The input plan changed on resume at step 40: "
                            "sharding file -> batch, input_pipelines 2 -> 1")


def test_repeated_or_empty_user_pipelines_are_one_line(root, tmp_path):
  files = tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(f"{root}/train-*")))
  parsed = files.map(_parse)
  with pytest.raises(ConfigError, match="must be finite and not empty "
                     r"\(leave out .repeat\(\)\). Received: infinite"):
    data.from_user("mine", parsed.repeat(), parsed)
  with pytest.raises(ConfigError, match="eval split must be finite"):
    data.from_user("mine", parsed, parsed.repeat())
  _write(str(tmp_path), [0])
  empty = tf.data.TFRecordDataset([f"{tmp_path}/train-000.tfrecord"]).map(
      _parse)
  with pytest.raises(ConfigError, match="the train split has no examples"):
    data.sample_batch(data.from_user("mine", empty, parsed))


def test_uneven_files_on_hosts_shard_by_batch_under_auto(dataset):
  """COUNTS on 2 hosts leave out more than MAX_LEFT_OUT by file."""
  from tfdist.data import sharding
  share = order.left_out_share(dataset.file_split.counts, 2, seed=0)
  assert share > sharding.MAX_LEFT_OUT
  assert sharding.resolve_sharding(dataset, "auto", 2, seed=0,
                                   streamed=True) == "batch"
  assert "would leave out" in sharding.describe(dataset, "batch", "auto", 2,
                                                True, 0)
  even = dataclasses.replace(dataset, file_split=dataclasses.replace(
      dataset.file_split, counts=(10,) * 8, paths=("p",) * 8),
      num_train_files=8)
  assert order.left_out_share(even.file_split.counts, 2, seed=0) == 0
  assert sharding.resolve_sharding(even, "auto", 2, seed=0,
                                   streamed=True) == "file"
