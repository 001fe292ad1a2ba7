"""The settings a user changes first, in one process: a seed of 0 on every
path a train pipeline takes, augmentation keyed by the example's place
(different on every host, new each epoch, continued after a resume, and
on batch sharding the single host's), a resume with another batch or
seed named, and file sharding of cached data held to the shortest
host."""

import dataclasses
import json

import numpy as np
import pytest
import tensorflow as tf

from tfdist import data
from tfdist.data import service_units
from tfdist.errors import ConfigError
from test_file_input import _file_data
from test_file_input import _write
from test_file_input import write_split_files

COUNTS = [30, 26, 34, 30, 28, 32]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  return write_split_files(tmp_path_factory, COUNTS)


@pytest.fixture
def global_seed_zero():
  """What keras.utils.set_random_seed(0) does to TF, undone after."""
  tf.random.set_seed(0)
  yield
  tf.random.set_seed(None)


@pytest.fixture
def global_seed_one():
  """A run's global seed (tfdist sets it): stateful draws repeat unless
  their graph seed differs."""
  tf.random.set_seed(1)
  yield
  tf.random.set_seed(None)


def _stateless(features, label, seed):
  return features + tf.random.stateless_uniform([1], seed, 0.0, 0.5), label


def _stateful(features, label):
  return features + tf.random.uniform([1], 0.0, 0.5), label


def _batches(dataset, *, hosts=1, host=0, steps=4, start_step=0, batch=8,
             seed=1, **kwargs):
  context = tf.distribute.InputContext(num_input_pipelines=hosts,
                                       input_pipeline_id=host,
                                       num_replicas_in_sync=hosts)
  batches = data.train_input_fn(dataset, global_batch_size=batch * hosts,
                                seed=seed, start_step=start_step,
                                **kwargs)(context)
  return [(f.numpy()[:, 0], l.numpy()) for f, l in batches.take(steps)]


def _draws(batches):
  """Each example's draw: its feature less its id."""
  return np.concatenate([f - l for f, l in batches])


def _ids(batches):
  return np.concatenate([l for _, l in batches]).tolist()


def _counting(calls):
  """features -> the same, appending to `calls` each time it runs."""
  def counted(value):
    calls.append(1)
    return value

  def through(features):
    return tf.numpy_function(counted, [features], tf.float32, stateful=True)
  return through


def _counting_parse(root, calls):
  parse, through = _file_data(root).parse, _counting(calls)

  def counted_parse(record):
    features, label = parse(record)
    return through(features), label
  return counted_parse


@pytest.mark.parametrize("augment", [None, _stateless, _stateful])
@pytest.mark.parametrize("cache,sharding", [
    ("off", "file"), ("off", "batch"), ("memory", "batch")])
def test_seed_zero_trains_on_every_path(root, global_seed_zero, augment,
                                        cache, sharding):
  dataset = data.file_dataset(_file_data(root, augment=augment), "zero")
  for host in range(2):
    assert len(_ids(_batches(dataset, hosts=2, host=host, seed=0,
                             cache=cache, sharding=sharding))) == 32


def test_seed_zero_on_a_users_pipeline_and_the_service(root,
                                                       global_seed_zero):
  files = sorted(tf.io.gfile.glob(f"{root}/train-*"))
  parse = _file_data(root).parse
  own = data.from_user("own", tf.data.TFRecordDataset(files).map(parse),
                       tf.data.TFRecordDataset(files).map(parse))
  assert len(_ids(_batches(own, seed=0))) == 32
  for dataset in (own, data.file_dataset(_file_data(
      root, augment=_stateless), "served")):
    served = service_units.served_batches(
        dataset, mode="dynamic", seed=0, first_unit=0, batch_size=8,
        buffer=50)
    assert next(iter(served))[1].shape == (8,)


def test_keyed_draws_differ_by_host_and_epoch_and_continue_on_resume(root):
  dataset = data.file_dataset(_file_data(root, augment=_stateless), "keyed")
  kwargs = dict(hosts=2, cache="off", sharding="file", shuffle_buffer=20)
  whole = _batches(dataset, host=1, steps=24, **kwargs)
  assert np.all((_draws(whole) >= 0) & (_draws(whole) < 0.5))
  # Rebuilt: the same draws. Resumed at step 10: the uninterrupted tail.
  assert np.array_equal(_draws(whole),
                         _draws(_batches(dataset, host=1, steps=24, **kwargs)))
  resumed = _batches(dataset, host=1, steps=14, start_step=10, **kwargs)
  assert _ids(resumed) == _ids(whole)[80:]
  assert np.array_equal(_draws(resumed), _draws(whole)[80:])
  # Host 0 draws apart from host 1 at the same places.
  other = _draws(_batches(dataset, host=0, steps=24, **kwargs))
  assert not np.any(other == _draws(whole))
  # 192 examples, over two of the host's epochs (about 90 each, files
  # dealt anew each epoch): an id read in two epochs gets two draws.
  ids, draws = _ids(whole), _draws(whole)
  twice = [i for i in set(ids) if ids.count(i) == 2]
  assert len(twice) >= 10
  for i in twice:
    first, second = [d for j, d in zip(ids, draws) if j == i]
    assert first != second


def test_batch_sharding_draws_what_one_host_draws(root):
  """Every host reads the one stream: the same keys, so two hosts' slices
  of a global batch are the single host's batch, draws included."""
  dataset = data.file_dataset(_file_data(root, augment=_stateless), "one")
  single = _batches(dataset, steps=6, batch=16, cache="off")
  halves = [_batches(dataset, hosts=2, host=h, steps=6, cache="off",
                     sharding="batch") for h in range(2)]
  for step, (features, labels) in enumerate(single):
    assert labels.tolist() == (halves[0][step][1].tolist()
                               + halves[1][step][1].tolist())
    assert np.array_equal(features, np.concatenate(
        [halves[0][step][0], halves[1][step][0]]))


def test_stateful_draws_differ_by_host_and_are_not_replayed(
    root, global_seed_one):
  dataset = data.file_dataset(_file_data(root, augment=_stateful), "stateful")
  kwargs = dict(hosts=2, cache="off", sharding="file", shuffle_buffer=20)
  # A parallel map hands a stateful op's values to examples in any order:
  # compare the values drawn, sorted.
  def drawn(**more):
    return np.sort(_draws(_batches(dataset, **kwargs, **more)))
  assert not np.allclose(drawn(host=0), drawn(host=1), atol=1e-4)
  # A resume draws anew: its first draws are not the run's first draws.
  assert not np.allclose(drawn(host=0, start_step=10), drawn(host=0),
                         atol=1e-4)


def test_a_resume_with_another_batch_or_seed_is_named():
  plan = {"global_batch_size": 64, "seed": 0, "sharding": "file",
          "input_pipelines": 2, "train_examples": 512, "train_files": 8,
          "shuffle_buffer": 10000}
  assert data.describe_plan_change(plan, dict(plan), 30) is None
  message = data.describe_plan_change(
      plan, {**plan, "global_batch_size": 32}, 30)
  assert message.startswith("The input plan changed on resume at step 30: "
                             "global_batch_size 64 -> 32.")
  assert "example 960, where 30 steps of 64 trained on 1920" in message
  assert "seed 0 -> 7" in data.describe_plan_change(plan, {**plan, "seed": 7},
                                                    30)
  # A plan saved before the seed was kept: not a change.
  older = {k: v for k, v in plan.items() if k != "seed"}
  assert data.describe_plan_change(older, plan, 30) is None


def test_the_plan_keeps_the_batch_and_the_seed(root):
  dataset = data.file_dataset(_file_data(root), "plan")
  inputs = data.inputs_from_dataset(dataset, global_batch_size=48, seed=0)
  assert inputs.plan["global_batch_size"] == 48 and inputs.plan["seed"] == 0


def test_parameter_server_file_sharding_of_cached_data_is_refused(root):
  """Asynchronous workers shard by file only streamed files (their
  dataset function is traced once); auto on cached data has each worker
  read everything."""
  dataset = data.file_dataset(_file_data(root), "ps")
  with pytest.raises(ConfigError, match=r"--input_sharding=file on "
                     r"parameter-server workers takes a tfdist.FileData "
                     r"streamed.*Received: input_sharding=file, "
                     r"cache=memory"):
    data.inputs_from_dataset(dataset, global_batch_size=8, seed=1,
                             sharding="file", num_hosts=2, cache="memory",
                             asynchronous=True)
  for cache, sharding, mode in (("memory", "auto", "batch"),
                                ("off", "file", "file")):
    inputs = data.inputs_from_dataset(
        dataset, global_batch_size=8, seed=1, sharding=sharding,
        num_hosts=2, cache=cache, asynchronous=True)
    assert inputs.plan["sharding"] == mode, cache


def _hand_built(root, zipped=False):
  files = sorted(tf.io.gfile.glob(f"{root}/train-*"))
  parse = _file_data(root).parse
  records = tf.data.TFRecordDataset(files)
  if zipped:  # A second source TF's rewrite cannot deal out.
    records = tf.data.Dataset.zip(
        (records, tf.data.Dataset.range(10**6))).map(lambda r, _: r)
  return data.from_user("own", records.map(parse),
                        tf.data.TFRecordDataset(files).map(parse))


def test_a_hand_built_pipeline_is_sharded_by_its_files(root):
  """TF's auto-shard rewrite finds the TFRecordDataset's 6 files: host h
  of 2 reads files h, h + 2, h + 4 only (92 and 88 examples), each once
  in its first 11 batches of 8."""
  from tfdist.data import sharding
  own = _hand_built(root)
  assert sharding.resolve_sharding(own, "auto", 2, seed=1) == "file"
  starts = np.cumsum([0] + COUNTS)
  for host in range(2):
    ids = _ids(_batches(own, hosts=2, host=host, steps=11, sharding="file"))
    assert len(set(ids)) == len(ids) == 88
    assert set(np.searchsorted(starts, ids, side="right") - 1) == set(
        range(host, len(COUNTS), 2)), host
  # Fewer files than hosts, or a source the rewrite cannot deal out:
  # auto reads everything on every host; file is one line.
  assert sharding.resolve_sharding(own, "auto", 7, seed=1) == "batch"
  zipped = _hand_built(root, zipped=True)
  assert sharding.resolve_sharding(zipped, "auto", 2, seed=1) == "batch"
  with pytest.raises(ConfigError, match=r"TF's auto-shard rewrite cannot "
                     r"deal own's files out to 2 hosts \(Found an "
                     r"unshardable source.*Received: input_sharding=file"):
    sharding.resolve_sharding(zipped, "file", 2, seed=1)


def test_a_hand_built_pipeline_is_probed_once(root, monkeypatch):
  """inputs_from_dataset decides file sharding (TF's rewrite tried on one
  element); the hosts' input functions take that decision, unprobed."""
  from tfdist.data import sharding
  probes = []
  probe = sharding._hand_built_sharding  # pylint: disable=protected-access
  monkeypatch.setattr(sharding, "_hand_built_sharding",
                      lambda *a: probes.append(a) or probe(*a))
  inputs = data.inputs_from_dataset(_hand_built(root), global_batch_size=16,
                                    seed=1, sharding="auto", num_hosts=2)
  for host in range(2):
    context = tf.distribute.InputContext(num_input_pipelines=2,
                                         input_pipeline_id=host,
                                         num_replicas_in_sync=2)
    next(iter(inputs.train_fn(0, 1)(context)))
  assert inputs.plan["sharding"] == "file" and len(probes) == 1


def test_file_sharding_of_cached_uneven_hosts_is_refused(root, tmp_path):
  """3 equal files on 2 hosts: host 0 holds two, host 1 one; a host's
  epoch is the shortest host's, so host 0's examples would be trained
  half as often. One line, not a skew."""
  _write(str(tmp_path), [20, 20, 20])
  _write(str(tmp_path), [4], prefix="eval")
  three = data.file_dataset(_file_data(str(tmp_path)), "three")
  with pytest.raises(ConfigError, match=r"hosts holding 20 to 40 examples "
                     r"would sample 33\.3% .* Use --cache=off"):
    _batches(three, hosts=2, cache="memory", sharding="file")
  # Streamed, files are dealt anew each epoch: allowed.
  assert len(_ids(_batches(three, hosts=2, cache="off",
                           sharding="file"))) == 32


def test_few_files_make_several_service_units(root):
  """Fewer than 8 files once made one unit per epoch, which 2 data
  workers read as two epochs at once."""
  dataset = data.file_dataset(_file_data(root), "units")
  assert service_units.slices_per_epoch(dataset) == 4
  three = dataclasses.replace(dataset, file_split=dataclasses.replace(
      dataset.file_split, paths=dataset.file_split.paths[:3],
      counts=dataset.file_split.counts[:3]))
  assert service_units.slices_per_epoch(three) == 3


def _write_pixels(root, compression):
  """100 records of 4096 bytes (uint8 pixels, all zero: GZIP shrinks them
  to almost nothing) that parse into 16 KiB of float32 each."""
  options = tf.io.TFRecordOptions(compression_type=compression)
  for split, count in (("train", 100), ("eval", 4)):
    with tf.io.TFRecordWriter(f"{root}/{split}-0", options) as out:
      for _ in range(count):
        out.write(bytes(4096))


def _pixels(record):
  pixels = tf.io.decode_raw(record, tf.uint8)
  return tf.cast(tf.reshape(pixels, [4096]), tf.float32), tf.constant(0)


@pytest.mark.parametrize("compression", ["", "GZIP"])
def test_cache_auto_weighs_what_the_cache_would_hold(tmp_path, monkeypatch,
                                                     compression):
  """400 KiB of records on disk (or less, compressed) are 1.6 MiB parsed:
  past a 1 MiB limit they are streamed, not cached."""
  from tfdist.data import cache as cache_lib
  monkeypatch.setattr(cache_lib, "AUTO_CACHE_BYTES", 1 << 20)
  _write_pixels(str(tmp_path), compression)
  pixels = data.file_dataset(data.FileData(
      train=f"{tmp_path}/train-*", eval=f"{tmp_path}/eval-*", parse=_pixels,
      compression=compression), "pixels")
  assert pixels.train_bytes < 1 << 20
  assert pixels.cache_bytes == 100 * (4096 * 4 + 4)  # Pixels and label.
  assert cache_lib.resolve("auto", pixels) == "off"
  assert "about 1.6 MiB parsed" in cache_lib.describe("off", pixels)
  monkeypatch.setattr(cache_lib, "AUTO_CACHE_BYTES", 2 << 20)
  assert cache_lib.resolve("auto", pixels) == "memory"


def test_a_task_may_return_file_data(root):
  import tfdist

  class FileTask(tfdist.Task):
    def build_model(self):
      raise AssertionError("not built here")

    def datasets(self):
      return _file_data(root)
  dataset = FileTask().data()
  assert dataset.file_split is not None and dataset.num_train_examples == 180


_CUT_SHORT = """
import os, sys
import tensorflow as tf
sys.path.insert(0, sys.argv[2])
from test_file_input import _file_data
from tfdist import data
# An augment and a small buffer: the first batch reads a few records.
dataset = data.file_dataset(_file_data(sys.argv[1], augment=lambda *e: e),
                            "cut")
batches = data.train_input_fn(dataset, global_batch_size=8, seed=1,
                              cache=sys.argv[3], shuffle_buffer=4)(
                                  tf.distribute.InputContext())
iterator = iter(batches)
for _ in range(5):  # The cache's first pass has begun, not ended.
  next(iterator)
os._exit(0)  # As a preempted worker ends: no clean-up.
"""


def test_a_file_cache_cut_short_is_written_again_and_a_live_one_kept(
    root, tmp_path):
  """A preempted first pass (TF's lockfile and partial shards, its writer
  gone) is written again; one whose writer still runs is one line; other
  data under the same --cache has files of its own, and both stay."""
  import os
  import subprocess
  import sys
  prefix = str(tmp_path / "cache")
  subprocess.run([sys.executable, "-c", _CUT_SHORT, root,
                  os.path.dirname(__file__), prefix], check=True,
                 capture_output=True, timeout=120)
  assert tf.io.gfile.glob(prefix + "-train-0-of-1-*_0.lockfile")
  dataset = data.file_dataset(_file_data(root), "cut")
  # 180 examples: 23 batches of 8 fill the cache, the rest is read from it.
  ids = _ids(_batches(dataset, steps=45, cache=prefix))
  assert sorted(ids[:176]) == sorted(set(ids[:176]))
  (index,) = tf.io.gfile.glob(prefix + "-train-0-of-1-*.index")
  assert _ids(_batches(dataset, steps=45, cache=prefix)) == ids
  # Other data under the same --cache: its own cache, not this one's.
  other = dataclasses.replace(dataset, name="other", num_train_examples=90,
                              file_split=dataclasses.replace(
                                  dataset.file_split,
                                  paths=dataset.file_split.paths[:3],
                                  counts=dataset.file_split.counts[:3]))
  other = dataclasses.replace(
      other, train_source=other.file_split.examples)
  again = _ids(_batches(other, steps=22, cache=prefix))
  assert max(again) < 90 and sorted(again[:88]) == sorted(set(again[:88]))
  assert len(tf.io.gfile.glob(prefix + "-train-0-of-1-*.index")) == 2
  assert tf.io.gfile.exists(index)
  # A first pass whose writer (a process of this host) still runs.
  live = subprocess.Popen([sys.executable, "-c",
                           "import time; time.sleep(60)"])
  try:
    subprocess.run([sys.executable, "-c", _CUT_SHORT, root,
                    os.path.dirname(__file__), str(tmp_path / "live")],
                   check=True, capture_output=True, timeout=120)
    (mark,) = tf.io.gfile.glob(f"{tmp_path}/live-train-0-of-1-*.tfdist.json")
    from tfdist.data import cache as cache_lib
    writer = {**json.load(open(mark)), "pid": live.pid,
              "start": cache_lib._started(live.pid)}  # pylint: disable=protected-access
    with open(mark, "w") as out:
      out.write(json.dumps(writer))
    with pytest.raises(ConfigError, match=r"cache at .*live-train-0-of-1-"
                       r"\w+\* is being written by .*pid \d+"):
      _batches(dataset, steps=1, cache=str(tmp_path / "live"))
    assert tf.io.gfile.glob(f"{tmp_path}/live-train-0-of-1-*_0.lockfile")
    # The same pid, another process (a container restarted in its pod).
    with open(mark, "w") as out:
      out.write(json.dumps({**writer, "start": writer["start"] - 1}))
    assert len(_ids(_batches(dataset, steps=23,
                             cache=str(tmp_path / "live")))) == 184
  finally:
    live.kill()
    live.wait()


def _read_bytes():
  with open("/proc/self/io") as io:
    return int(dict(line.split(": ") for line in io.read().splitlines())
               ["rchar"])


def test_a_resume_counts_nothing_again(tmp_path, monkeypatch):
  """GZIP files are counted by decompressing them: 3 MB read. With the
  counts an earlier run kept (or a user's), only the parse check's first
  record is read, and no file is counted unless it changed."""
  from tfdist.data import counts as counts_lib
  rng = np.random.default_rng(0)
  options = tf.io.TFRecordOptions(compression_type="GZIP")
  for f in range(8):
    with tf.io.TFRecordWriter(f"{tmp_path}/train-{f}", options) as out:
      for _ in range(200):
        out.write(rng.bytes(2000))  # Incompressible.
  with tf.io.TFRecordWriter(f"{tmp_path}/eval-0", options) as out:
    out.write(rng.bytes(2000))
  file_data = data.FileData(train=f"{tmp_path}/train-*",
                            eval=f"{tmp_path}/eval-*", parse=_length,
                            compression="GZIP")
  before = _read_bytes()
  first = data.file_dataset(file_data, "gzip")
  assert _read_bytes() - before > 3_000_000
  counted = []
  original = counts_lib.count_records
  monkeypatch.setattr(counts_lib, "count_records",
                      lambda path, c: counted.append(path) or original(path,
                                                                       c))
  before = _read_bytes()
  again = data.file_dataset(file_data, "gzip", first.record_counts)
  assert _read_bytes() - before < 1_000_000 and not counted
  assert again.file_split.counts == first.file_split.counts == (200,) * 8
  # A file rewritten since is counted again; a user's counts are used.
  with tf.io.TFRecordWriter(f"{tmp_path}/train-3", options) as out:
    out.write(rng.bytes(2000))
  changed = data.file_dataset(file_data, "gzip", first.record_counts)
  assert counted == [f"{tmp_path}/train-3"]
  assert changed.file_split.counts[3] == 1
  given = dataclasses.replace(file_data, record_counts={
      f"{tmp_path}/train-{f}": 1 if f == 3 else 200 for f in range(8)})
  assert data.file_dataset(given, "given").num_train_examples == 1401
  assert counted == [f"{tmp_path}/train-3", f"{tmp_path}/eval-0"]
  with pytest.raises(ConfigError, match=r"record_counts takes \{path: "
                     r"records\}.*Received: record_counts=\{'a': -1\}"):
    dataclasses.replace(file_data, record_counts={"a": -1})


def _length(record):
  return tf.cast(tf.strings.length(record), tf.float32)[None], tf.constant(0)


@pytest.mark.parametrize("cache", ["off", "memory"])
def test_batch_sharding_parses_and_augments_a_share_per_host(root, cache):
  """Each of 2 hosts reads the whole stream but parses (streamed) and
  augments only the batches it keeps: 544 examples taken, not 1088. A
  cache parses each of the 180 records once. The slack is the read-ahead
  past the last batch taken, which grows on a loaded machine (78 seen)."""
  parsed, augmented = [], []
  through = _counting(augmented)
  dataset = data.file_dataset(data.FileData(
      train=f"{root}/train-*", eval=f"{root}/eval-*",
      parse=_counting_parse(root, parsed),
      augment=lambda features, label: (through(features), label)),
      "counted")
  parsed.clear()
  kept = _ids(_batches(dataset, hosts=2, host=1, steps=68, cache=cache,
                       sharding="batch"))
  assert len(kept) == 544
  assert 544 <= len(augmented) < 544 + 200, len(augmented)
  if cache == "off":
    assert 544 <= len(parsed) < 544 + 200, len(parsed)
  else:
    assert len(parsed) == sum(COUNTS), len(parsed)


def test_locate_walks_the_epochs_in_one_call():
  """locate's epochs (a graph loop) are epoch_length's, summed."""
  import random
  from tfdist.data import order
  rng = random.Random(0)
  for _ in range(20):
    counts = [rng.randint(1, 40) for _ in range(rng.randint(2, 12))]
    hosts, seed = rng.randint(2, min(4, len(counts))), rng.randint(0, 5)
    position = rng.randint(0, 30 * sum(counts))
    epoch, into = order.locate(counts, seed, hosts, 0, position)
    assert sum(order.epoch_length(counts, seed, e, hosts)
               for e in range(epoch)) + into == position
    assert 0 <= into < order.epoch_length(counts, seed, epoch, hosts)


def test_asynchronous_workers_skip_nothing_of_their_own_order(root):
  """A PS worker's user pipeline is in an order of its own (no seed):
  a resume at step 100 has nothing to get back to, and reads nothing
  to skip (it once read and parsed 800 examples first)."""
  calls = []
  files = sorted(tf.io.gfile.glob(f"{root}/train-*"))
  own = data.from_user("own", tf.data.TFRecordDataset(files).map(
      _counting_parse(root, calls)), tf.data.TFRecordDataset(files).map(
          _file_data(root).parse))
  calls.clear()
  assert len(_ids(_batches(own, seed=None, start_step=100, steps=2))) == 16
  assert len(calls) < 400, len(calls)


def test_the_service_refuses_ops_its_data_workers_lack(root):
  """tfdist's own served pipelines use only TensorFlow's ops; an op from
  a library loaded with tf.load_op_library (ZeroOut, TF's example) is
  named."""
  from tfdist.data import sources
  own = data.from_user("own", *(tf.data.TFRecordDataset(sorted(
      tf.io.gfile.glob(f"{root}/train-*"))).map(_file_data(root).parse),) * 2)
  for dataset in (own, *(data.file_dataset(_file_data(
      root, augment=augment), "served") for augment in (_stateless,
                                                         _stateful))):
    served = service_units.served_batches(
        dataset, mode="dynamic", seed=0, first_unit=0, batch_size=8,
        buffer=50)
    assert sources.unservable_ops(served) == {"python": set(),
                                              "foreign": set()}
  assert sources.foreign_ops({"MapDataset", "ZeroOut"}) == {"ZeroOut"}


def test_streamed_eval_parses_a_share_per_host_and_stays_exact(root):
  calls = []
  dataset = data.file_dataset(data.FileData(
      train=f"{root}/train-*", eval=f"{root}/eval-*",
      parse=_counting_parse(root, calls)), "eval")
  assert dataset.num_test_examples == 12
  real = []
  calls.clear()
  for host in range(2):
    context = tf.distribute.InputContext(num_input_pipelines=2,
                                         input_pipeline_id=host,
                                         num_replicas_in_sync=2)
    batches = data.eval_input_fn(dataset, global_batch_size=8)(context)
    for _, labels, mask in batches:
      real.extend(l for l, m in zip(labels.numpy(), mask.numpy()) if m)
  # 12 examples padded to 16: each host parses its 8, not all 16.
  assert sorted(real) == list(range(12)) and len(calls) == 16


def test_streamed_eval_on_hosts_reads_their_own_files(root):
  """The eval files of 7 and 5 records on 2 hosts, as eval_steps counts
  them for 2: host 0 reads the first file only, host 1 the second, each
  padded to the 2 batches of 4 that the first needs; together each
  example once."""
  dataset = data.file_dataset(data.FileData(
      train=f"{root}/train-*", eval=f"{root}/eval-*",
      parse=_file_data(root).parse), "eval")
  assert data.eval_steps(dataset, global_batch_size=8, num_hosts=2) == 2
  real = []
  for host in range(2):
    context = tf.distribute.InputContext(num_input_pipelines=2,
                                         input_pipeline_id=host,
                                         num_replicas_in_sync=2)
    batches = list(data.eval_input_fn(dataset, global_batch_size=8,
                                      num_hosts=2)(context))
    assert len(batches) == 2
    real.append(sorted(l for _, labels, mask in batches
                       for l, m in zip(labels.numpy(), mask.numpy()) if m))
  assert real == [list(range(7)), list(range(7, 12))]


def test_eval_reads_by_batch_where_reading_by_file_would_differ(
    root, tmp_path):
  """Every host reads the eval split where its own files would pad more
  batches (files of 30 and 2: 15 batches of 2 against 8), where hosts
  outnumber the files, and where --eval_steps caps the eval below its
  batches by file (the same examples on any number of hosts: host 0's
  first batch holds records of both files, interleaved)."""
  from tfdist.data import eval_input
  uneven = tmp_path / "uneven"
  uneven.mkdir()
  _write(str(uneven), [30, 2], prefix="eval")
  _write(str(uneven), [8, 8])
  lopsided = data.file_dataset(data.FileData(
      train=f"{uneven}/train-*", eval=f"{uneven}/eval-*",
      parse=_file_data(root).parse), "uneven")
  assert eval_input.by_file_steps(lopsided, 4, 2, "auto") is None
  assert data.eval_steps(lopsided, global_batch_size=4, num_hosts=2) == 8
  dataset = data.file_dataset(data.FileData(
      train=f"{root}/train-*", eval=f"{root}/eval-*",
      parse=_file_data(root).parse), "eval")
  assert eval_input.by_file_steps(dataset, 12, 3, "auto") is None
  assert eval_input.by_file_steps(dataset, 8, 2, "auto") == 2
  capped = data.inputs_from_dataset(dataset, global_batch_size=8, seed=1,
                                    num_hosts=2, eval_steps_requested=1)
  context = tf.distribute.InputContext(num_input_pipelines=2,
                                       input_pipeline_id=0,
                                       num_replicas_in_sync=2)
  _, labels, _ = next(iter(capped.eval_fn()(context)))
  assert sorted(labels.numpy()) == [0, 1, 7, 8]


def test_batch_sharding_takes_examples_of_any_shape(root):
  """Each host keeps its batches before the augment: parsed examples of
  varying length, which the augment makes one length, pass (a batch of
  them before the augment could not be made)."""
  def ragged(record):
    features, label = _file_data(root).parse(record)
    return tf.repeat(features, label % 3 + 1), label

  def fixed(features, label, seed):
    del seed
    return tf.concat([features, tf.zeros([4])], 0)[:4], label
  dataset = data.file_dataset(data.FileData(
      train=f"{root}/train-*", eval=f"{root}/eval-*", parse=ragged,
      augment=fixed), "ragged")
  for cache in ("off", "memory"):
    halves = [_ids(_batches(dataset, hosts=2, host=h, cache=cache,
                            sharding="batch")) for h in range(2)]
    assert not set(halves[0]) & set(halves[1]) and len(halves[0]) == 32


def test_stateful_draws_differ_by_host_under_batch_sharding(
    root, global_seed_one):
  dataset = data.file_dataset(_file_data(root, augment=_stateful), "apart")
  drawn = [np.sort(_draws(_batches(dataset, hosts=2, host=h, cache="off",
                                   sharding="batch"))) for h in range(2)]
  assert not np.allclose(drawn[0], drawn[1], atol=1e-4)


def test_counts_a_user_gives_are_used_compared_and_not_reused(root):
  """Kept marked as given: the workers' digest covers the file, and a
  later run without the user's count counts it."""
  paths = sorted(tf.io.gfile.glob(f"{root}/train-*"))
  given = _file_data(root, record_counts={paths[0]: np.int64(29)})
  dataset = data.file_dataset(given, "given")
  assert dataset.file_split.counts[0] == 29
  assert dataset.record_counts[paths[0]][2:] == [29, "given"]
  assert len(dataset.record_counts[paths[1]]) == 3
  later = data.file_dataset(_file_data(root), "later",
                            dataset.record_counts)
  assert later.file_split.counts[0] == 30
