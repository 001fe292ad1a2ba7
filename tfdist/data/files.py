"""The file-backed input contract: where the files are and how to read one
record.

    def my_data():  # --dataset=my_module:my_data
      return tfdist.FileData(train="gs://b/train-*.tfrecord",
                             eval="gs://b/eval-*.tfrecord",
                             parse=parse_example, augment=random_flip,
                             num_classes=1000)

Patterns go through tf.io.gfile (local paths, gs://, ram://). tfdist counts
each file's records from the TFRecord headers (without reading the
records themselves), then streams the files: nothing is cached unless it
fits (--cache), hosts read their own files, and a resume starts where it
stopped without rereading (tfdist.data.order).
"""

import dataclasses
import time
from typing import Callable, Mapping, Optional, Sequence, Tuple, Union

from absl import logging
import tensorflow as tf

from tfdist import errors
from tfdist.data import cache as cache_lib
from tfdist.data import counts as counts_lib
from tfdist.data import order
from tfdist.data import sources
from tfdist.errors import ConfigError

COMPRESSIONS = ("", "GZIP", "ZLIB")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileData:
  """TFRecord files for training and eval, and how to read a record.

  train, eval: a glob pattern or a list of patterns (tf.io.gfile).
  parse: one serialized record -> (features, labels) or (features, labels,
    sample_weight), with TensorFlow ops (it runs inside tf.data).
  augment: optional, (features, labels[, sample_weight]) -> the same, for
    training only; it runs after any cache, so each epoch draws anew.
  num_classes: the number of classes, for a zoo model (--model=resnet20,
    say); a model of your own does not need it.
  compression: "", "GZIP" or "ZLIB", as the files were written.
  record_counts: optional, {path: records} for files whose records you
    know (paths as the patterns match them): those are not counted. A run
    also keeps the counts it made, so a resume counts nothing again.
  """

  train: Union[str, Sequence[str]]
  eval: Union[str, Sequence[str]]
  parse: Callable
  augment: Optional[Callable] = None
  num_classes: Optional[int] = None
  compression: str = ""
  record_counts: Optional[Mapping[str, int]] = None

  def __post_init__(self):
    for name in ("train", "eval"):
      patterns = getattr(self, name)
      if isinstance(patterns, str):
        patterns = [patterns]
      if not (isinstance(patterns, (list, tuple)) and patterns and all(
          isinstance(p, str) and p for p in patterns)):
        raise ConfigError(f"FileData {name} takes a file pattern or a list "
                          f"of them. Received: {name}={patterns!r}")
    for name in ("parse", "augment"):
      value = getattr(self, name)
      if not (callable(value) or (name == "augment" and value is None)):
        raise ConfigError(f"FileData {name} must be a function. Received: "
                          f"{name}={value!r}")
    if self.num_classes is not None and not (
        isinstance(self.num_classes, int) and self.num_classes > 0):
      raise ConfigError("FileData num_classes must be a positive integer. "
                        f"Received: num_classes={self.num_classes!r}")
    counts_lib.check_given(self.record_counts)
    if self.compression not in COMPRESSIONS:
      raise ConfigError(f"FileData compression must be one of "
                        f"{COMPRESSIONS}. Received: "
                        f"compression={self.compression!r}")


@dataclasses.dataclass(frozen=True)
class FileSplit:
  """One split's files (sorted, none empty) and their record counts."""

  paths: Tuple[str, ...]
  counts: Tuple[int, ...]
  compression: str
  parse: Callable
  # {path: counts.Found} of every file matched, empty ones included.
  found: dict = dataclasses.field(default_factory=dict, compare=False)

  @property
  def num_examples(self):
    return sum(self.counts)

  @property
  def remote(self):
    """Whether the files are on remote storage (gs://, s3://, hdfs://,
    ram://...), where reads wait on the network and go in parallel."""
    return any("://" in path and not path.startswith("file://")
               for path in self.paths)

  def reader(self, path):
    return tf.data.TFRecordDataset(path, compression_type=self.compression)

  def records(self):
    """Every record once, 8 files interleaved record by record (the same
    order wherever the files are): for eval and caching."""
    return order.interleave(tf.constant(self.paths),
                            tf.zeros([len(self.paths)], tf.int64), self)

  def examples(self):
    return self.records().map(self.parse,
                              num_parallel_calls=tf.data.AUTOTUNE)


def _expand(patterns, split, name):
  if isinstance(patterns, str):
    patterns = [patterns]
  paths = set()
  for pattern in patterns:
    try:
      matched = tf.io.gfile.glob(pattern)
    except tf.errors.OpError as e:
      raise ConfigError(f"{name}: cannot list {split} files {pattern!r}: "
                        f"{errors.first_line(e)}") from None
    if not matched:
      raise ConfigError(f"{name}: no {split} file matches {pattern!r}.")
    paths.update(matched)
  return sorted(paths)


def _split(file_data, split, name, known):
  start = time.perf_counter()
  paths = _expand(getattr(file_data, split), split, name)
  found = counts_lib.record_counts(
      paths, file_data.compression, name,
      known={**(known or {}), **counts_lib.given(file_data.record_counts)})
  kept = [(p, found[p]) for p in paths if found[p].records]
  if not kept:
    raise ConfigError(f"{name}: the {split} files hold no records. "
                      f"Received: {len(paths)} file(s), first {paths[0]}")
  counted = sum(1 for f in found.values() if f.counted)
  logging.info("%s %s: %d records in %d file(s)%s; %d file(s) counted in "
               "%.2f s, %d known.", name, split,
               sum(f.records for _, f in kept), len(kept),
               f" ({len(paths) - len(kept)} empty, skipped)"
               if len(kept) < len(paths) else "", counted,
               time.perf_counter() - start, len(paths) - counted)
  return FileSplit(paths=tuple(p for p, _ in kept),
                   counts=tuple(f.records for _, f in kept),
                   compression=file_data.compression, parse=file_data.parse,
                   found=found)


def to_dataset(file_data: FileData, name, known_counts=None
               ) -> sources.Dataset:
  """The Dataset of a FileData: its splits counted (but for the files in
  `known_counts`, an earlier run's record_counts, unchanged since), parse
  checked on the first record of each."""
  train = _split(file_data, "train", name, known_counts)
  test = _split(file_data, "eval", name, known_counts)
  first = _check_parse(train, "train", name)
  _check_parse(test, "eval", name)
  return sources.Dataset(
      name=name, num_train_examples=train.num_examples,
      num_test_examples=test.num_examples,
      train_source=train.examples, test_source=test.examples,
      num_classes=file_data.num_classes, num_train_files=len(train.paths),
      train_files=lambda hosts, host: _host_files(train, hosts, host),
      file_split=train, eval_split=test, augment=file_data.augment,
      train_bytes=sum(train.found[p].length for p in train.paths),
      in_memory=False,
      cache_bytes=cache_lib.example_bytes(first) * train.num_examples,
      record_counts=counts_lib.to_keep({**train.found, **test.found}))


def _check_parse(files, split, name):
  """Parses the split's first record, and returns it: a parse that does
  not fit the records fails here in one line, not at step 0 in a
  traceback."""
  try:
    # The first file only: a parallel read of all would fill a buffer of
    # each (256 KiB per file, 2 MiB of 8 files, for one record).
    examples = dataclasses.replace(files, paths=files.paths[:1],
                                   counts=files.counts[:1]).examples()
    sources.check_element_spec(name, split, examples.element_spec)
    return next(iter(examples.take(1)))
  except ConfigError:
    raise
  except Exception as e:  # The user's parse may raise anything.
    raise ConfigError(f"{name}: parse failed on a {split} record: "
                      f"{type(e).__name__}: "
                      f"{errors.first_line(e, 200, empty='')}") from None


def _host_files(split, hosts, host):
  """A host's own files, for the cached path: files host, host + hosts,
  ... (the streamed path permutes them every epoch)."""
  paths = split.paths[host::hosts]
  mine = dataclasses.replace(split, paths=paths,
                             counts=split.counts[host::hosts])
  return mine.examples, mine.num_examples
