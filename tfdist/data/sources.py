"""Dataset: unbatched examples per split, and a user's own tf.data
datasets turned into one.

A Dataset holds unbatched (features, labels) or (features, labels,
sample_weight) examples per split, where features is a tensor or a dict of
tensors. Where it comes from decides what tfdist can do with it: a source
in memory is counted and cached; a split read from files (`file_split`,
see tfdist.data.files) is streamed in a planned order; a user's own
tf.data pipeline over files is streamed as it is.
"""

import dataclasses
import functools
import re
from typing import Callable, Optional, Tuple

from absl import logging
import tensorflow as tf

from tfdist import errors
from tfdist.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Unbatched (features, labels) examples: a source per split.

  `input_shape` and `num_classes` are set for the built-in image
  classification data, or by the user; otherwise None.
  """

  name: str
  num_train_examples: Optional[int]  # None: not known before reading.
  num_test_examples: Optional[int]  # None: infinite (synthetic).
  train_source: Callable[[], tf.data.Dataset]
  test_source: Callable[[], tf.data.Dataset]
  input_shape: Optional[Tuple[int, ...]] = None
  num_classes: Optional[int] = None
  # (num_hosts, host_id) -> (source, num_examples) of that host's own
  # files, read once and cached (--input_sharding=file). None: no files.
  train_files: Optional[Callable[[int, int], Tuple[Callable, int]]] = None
  num_train_files: int = 0
  # The train split's files, record counts and parse: streamed in a
  # planned order (tfdist.data.order) unless it is cached.
  file_split: Optional[object] = None
  # (features, labels[, sample_weight]) -> the same: train only, after any
  # cache, so that each epoch draws its own random augmentation.
  augment: Optional[Callable] = None
  # Bytes of the train split on disk, when known.
  train_bytes: Optional[int] = None
  # Bytes its parsed examples take, estimated: what --cache=auto weighs
  # (train_bytes when unknown).
  cache_bytes: Optional[int] = None
  # {path: [bytes, mtime, records]} of the files counted (FileData): kept
  # in the run record, so that a resume does not count them again.
  record_counts: Optional[dict] = None
  # The eval split's files, when read from files: streamed, each host
  # parses only the eval batches it keeps.
  eval_split: Optional[object] = None
  # A user's train pipeline as they built it, without tfdist's cache:
  # what the tf.data service may split at its source.
  train_pipeline: Optional[Callable[[], tf.data.Dataset]] = None
  # The source holds its data in this process (arrays): caching is free.
  in_memory: bool = True


_FILE_READERS = frozenset((
    "TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset",
    "TextLineDatasetV2", "FixedLengthRecordDataset",
    "FixedLengthRecordDatasetV2", "ArrayRecordDataset", "ReadFile",
    "CSVDataset", "CSVDatasetV2", "LoadDataset", "SqlDataset"))


def _graph_def(dataset, policy):
  return tf.raw_ops.DatasetToGraphV2(
      input_dataset=dataset._variant_tensor,  # pylint: disable=protected-access
      external_state_policy=policy, strip_device_assignment=True)


_PYTHON_OPS = frozenset(("EagerPyFunc", "PyFunc", "PyFuncStateless"))


def pipeline_graph(dataset):
  """A pipeline's GraphDef; None when it cannot be serialized (a
  generator, say)."""
  try:
    return tf.compat.v1.GraphDef.FromString(
        _graph_def(dataset, _WARN).numpy())
  except (tf.errors.OpError, ValueError):
    return None


def _graph_ops(dataset):
  """The op types of a pipeline's graph, its functions' included; None
  when it cannot be serialized."""
  graph = pipeline_graph(dataset)
  if graph is None:
    return None
  ops = {node.op for node in graph.node}
  for function in graph.library.function:
    ops.update(node.op for node in function.node_def)
  # A call of one of the graph's own functions is not an op.
  return ops - {function.signature.name
                for function in graph.library.function}


def reads_files(dataset):
  """Whether a tf.data pipeline reads files (TF's auto-shard rewrite looks
  for the same reader ops): such a pipeline is streamed, not cached."""
  return bool((_graph_ops(dataset) or set()) & _FILE_READERS)


def unservable_ops(dataset):
  """What in a pipeline the tf.data service's data workers cannot run:
  {"python": ops that run Python (py_function, numpy_function),
  "foreign": ops that are not TensorFlow's own (a library loaded with
  tf.load_op_library here, which a data worker has not loaded)}; None
  when the pipeline cannot be serialized at all (a generator, say)."""
  ops = _graph_ops(dataset)
  if ops is None:
    return None
  return {"python": ops & _PYTHON_OPS, "foreign": foreign_ops(ops)}


def foreign_ops(ops):
  """The op types of `ops` that TensorFlow itself does not define (its
  internal ops, _Retval and the like, start with an underscore)."""
  return {op for op in ops
          if not (op.startswith("_") or hasattr(tf.raw_ops, op))}


def count(dataset):
  """Examples in `dataset`: its cardinality, or one pass when TF does not
  know it (only for data in memory). None: infinite."""
  size = int(dataset.cardinality())
  if size >= 0:
    return size
  if size == int(tf.data.INFINITE_CARDINALITY):
    return None
  return int(dataset.reduce(0, lambda total, _: total + 1))


def _check_examples(name, split, dataset):
  if not isinstance(dataset, tf.data.Dataset):
    raise ConfigError(f"{name} must return (train, eval) tf.data.Datasets; "
                      f"its {split} part is a {type(dataset).__name__}.")
  check_element_spec(name, split, dataset.element_spec)


def check_element_spec(name, split, spec):
  if not (isinstance(spec, tuple) and len(spec) in (2, 3)):
    raise ConfigError(f"{name}: each {split} example must be (features, "
                      f"labels) or (features, labels, sample_weight). "
                      f"Received: element_spec={spec}")
  if len(spec) == 3 and not (
      isinstance(spec[2], tf.TensorSpec) and spec[2].dtype.is_floating
      and spec[2].shape.rank == 0):
    raise ConfigError(f"{name}: a {split} example's sample_weight must be "
                      f"one float (a scalar). Received: {spec[2]}")


def from_user(name, train, test):
  """A Dataset from two unbatched tf.data.Datasets of (features, labels)
  or (features, labels, sample_weight).

  In memory (arrays, from_tensor_slices): counted and cached. Read from
  files: streamed, never cached and never read ahead of training, since
  the files may not fit in memory; tfdist.FileData does more with files
  (sharding by file, a resume that rereads nothing).
  """
  for split, dataset in (("train", train), ("eval", test)):
    _check_examples(name, split, dataset)
  streamed, test_streamed = reads_files(train), reads_files(test)
  if streamed:
    logging.info(
        "%s reads files: streamed, not cached. A resume reads up to its "
        "position again; return a tfdist.FileData for a resume that "
        "rereads nothing and hosts' epochs kept in step.", name)
  num_train = _train_size(name, train, streamed)
  return Dataset(name=name, num_train_examples=num_train,
                 num_test_examples=_count_streamed(name, test)
                 if test_streamed else count(test),
                 train_source=portable_source(train, f"{name} (train)",
                                              cache=not streamed),
                 test_source=portable_source(test, f"{name} (eval)",
                                             cache=not test_streamed),
                 in_memory=not streamed, train_pipeline=lambda: train)


def _train_size(name, train, streamed):
  """Examples in the train split; None for files of unknown size (epochs
  end when the files do)."""
  size = int(train.cardinality()) if streamed else count(train)
  if streamed and size == int(tf.data.UNKNOWN_CARDINALITY):
    return None
  if size is None or size <= 0:  # count: None; cardinality: -1, infinite.
    infinite = size is None or size == int(tf.data.INFINITE_CARDINALITY)
    raise ConfigError(f"{name}: the train split must be finite and not "
                      "empty (leave out .repeat()). Received: "
                      f"{'infinite' if infinite else size} examples")
  return size


def _count_streamed(name, test):
  """An eval split read from files, counted once without keeping it: exact
  eval pads to whole batches and must know where the real examples end."""
  size = int(test.cardinality())
  if size >= 0:
    return size
  if size == int(tf.data.INFINITE_CARDINALITY):
    raise ConfigError(f"{name}: the eval split must be finite (leave out "
                      ".repeat()). Received: infinite examples")
  logging.info("%s (eval) reads files of unknown size: counting its "
               "examples once (tfdist.FileData counts records instead).",
               name)
  return int(test.reduce(0, lambda total, _: total + 1))


_WARN, _FAIL = 0, 2  # DatasetToGraphV2's external_state_policy values.


def portable_source(dataset, name, cache=True):
  """A source of `dataset` that any task of the cluster can call.

  A dataset made in this process (numpy arrays, say) is a handle to state
  in this process only. Called eagerly, the source returns it (cached if
  `cache`). Called while a function is traced (a parameter-server worker's
  dataset function, which is shipped to other processes), it returns the
  dataset rebuilt from its serialized graph, which carries the arrays with
  it.
  """
  local = dataset.cache() if cache else dataset
  graph = []

  def serialized():
    if not graph:
      with tf.init_scope():  # Serialize eagerly, once, in this process.
        try:
          graph.append(_graph_def(dataset, _FAIL))
        except tf.errors.FailedPreconditionError as e:
          logging.warning(
              "%s holds state of this process (%s); other tasks get a "
              "fresh copy of it.", name, errors.first_line(e))
          graph.append(_graph_def(dataset, _WARN))
    return graph[0]

  def source():
    if tf.executing_eagerly():
      return local
    rebuilt = tf.data.experimental.from_variant(
        tf.raw_ops.DatasetFromGraph(graph_def=serialized()),
        dataset.element_spec)
    return rebuilt.cache() if cache else rebuilt
  return source


def features_spec(dataset: Dataset):
  return dataset.train_source().element_spec[0]


def sample_batch(dataset: Dataset, size=2):
  """A few (features, labels), batched: to check a model against the
  data."""
  for batch in dataset.train_source().batch(size).take(1):
    return tuple(batch[:2])
  raise ConfigError(f"{dataset.name}: the train split has no examples.")


# Sources TF's tf.data service can split among its data workers
# (ShardingPolicy.DYNAMIC), and the transformations that act on each
# element alone, so that running them on each worker's splits gives the
# same examples: a pipeline made of one such source and these only may
# have its source split.
_SPLITTABLE_SOURCES = frozenset((
    "RangeDataset", "TensorSliceDataset", "TFRecordDataset",
    "TFRecordDatasetV2", "TextLineDataset", "TextLineDatasetV2",
    "FixedLengthRecordDataset", "FixedLengthRecordDatasetV2"))
_PER_ELEMENT = frozenset((
    "MapDataset", "ParallelMapDataset", "ParallelMapDatasetV2",
    "FilterDataset", "ShuffleDataset", "ShuffleDatasetV2",
    "ShuffleDatasetV3", "PrefetchDataset",
    "InterleaveDataset", "ParallelInterleaveDatasetV2",
    "ParallelInterleaveDatasetV3", "ParallelInterleaveDatasetV4",
    "FlatMapDataset", "OptionsDataset", "ModelDataset",
    "MaxIntraOpParallelismDataset", "PrivateThreadPoolDataset",
    "IgnoreErrorsDatasetV2"))
# Not per element under a split source: a cache (each data worker would
# keep its first epoch's splits for good), assert_cardinality (each
# worker's share is smaller), take, skip, zip, enumerate, batch.


@functools.lru_cache(maxsize=8)
def splits_by_source(dataset):
  """Whether the tf.data service may split `dataset`'s source among its
  data workers: one splittable source (a range, tensor slices, a list of
  files) and per-element transformations after it (map, filter,
  shuffle, interleave), nothing that counts or pairs elements (take,
  skip, zip, enumerate, batch), which would act on each worker's splits
  apart. Transformations inside functions (an interleave's files) are
  not split."""
  graph = pipeline_graph(dataset)
  if graph is None:
    return False
  kinds = [node.op for node in graph.node
           if re.fullmatch(r"\w+Dataset(V\d+)?", node.op)]
  sources_ = [op for op in kinds if op in _SPLITTABLE_SOURCES]
  return len(sources_) == 1 and all(
      op in _SPLITTABLE_SOURCES or op in _PER_ELEMENT for op in kinds)
