"""The built-in datasets: `digits` (offline), `synthetic`, and tfds image
catalog names prepared in a data_dir."""

import os

from absl import logging
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdist import digits
from tfdist import errors
from tfdist.data import cache as cache_lib
from tfdist.data import files
from tfdist.data import sources
from tfdist.errors import ConfigError, TfdistError


def _normalize(image, label):
  return tf.cast(image, tf.float32) / 255.0, tf.cast(label, tf.int32)


def _file_split(builder, split):
  """The split's TFRecord files, counted by tfds, parsed as
  as_supervised does: the streamed path reads them in its own order."""
  info = builder.info.splits[split]
  if builder.info.file_format != tfds.core.FileFormat.TFRECORD:
    return None
  image_key, label_key = builder.info.supervised_keys

  def parse(record):
    example = builder.info.features.deserialize_example(record)
    return _normalize(example[image_key], example[label_key])

  kept = [(str(p), n) for p, n in zip(info.filepaths, info.shard_lengths)
          if n]
  return files.FileSplit(paths=tuple(p for p, _ in kept),
                         counts=tuple(n for _, n in kept), compression="",
                         parse=parse)


def _from_builder(builder):
  features = builder.info.features
  splits = builder.info.splits
  test_split = "test" if "test" in splits else "validation"
  if "train" not in splits or test_split not in splits:
    raise ConfigError(f"dataset {builder.name!r} needs a train split and a "
                      f"test or validation split; it has {list(splits)}.")

  def source(split, context=None):
    return lambda: builder.as_dataset(
        split=split, as_supervised=True,
        read_config=tfds.ReadConfig(shuffle_seed=0,
                                    input_context=context)).map(
            _normalize, num_parallel_calls=tf.data.AUTOTUNE)

  shard_lengths = splits["train"].shard_lengths

  def train_files(num_hosts, host_id):
    # tfds gives host i files i, i + num_hosts, ... (its FILE sharding).
    context = tf.distribute.InputContext(num_input_pipelines=num_hosts,
                                         input_pipeline_id=host_id)
    return (source("train", context),
            sum(shard_lengths[host_id::num_hosts]))

  return sources.Dataset(
      train_files=train_files,
      num_train_files=sum(1 for n in shard_lengths if n),
      name=builder.name, input_shape=tuple(features["image"].shape),
      num_classes=features["label"].num_classes,
      num_train_examples=splits["train"].num_examples,
      num_test_examples=splits[test_split].num_examples,
      train_source=source("train"), test_source=source(test_split),
      file_split=_file_split(builder, "train"),
      train_bytes=splits["train"].num_bytes, in_memory=False,
      cache_bytes=_parsed_bytes(features, splits["train"].num_examples))


def _parsed_bytes(features, num_examples):
  """Decoded float32 images and int32 labels, when the shape is fixed."""
  one = cache_lib.spec_bytes((
      tf.TensorSpec(features["image"].shape, tf.float32),
      tf.TensorSpec([], tf.int32)))
  return None if one is None else one * num_examples


def _synthetic(shape, num_classes, seed, size=1024):
  def source():
    images = tf.random.stateless_uniform((size,) + tuple(shape), (seed, 1))
    labels = tf.random.stateless_uniform((size,), (seed, 2), maxval=num_classes,
                                         dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices((images, labels)).cache()
  return sources.Dataset(name="synthetic", input_shape=tuple(shape),
                         num_classes=num_classes, num_train_examples=size,
                         num_test_examples=None,
                         train_source=source, test_source=source)


def _catalog_builder(name, data_dir):
  if name not in tfds.list_builders():
    raise ConfigError(
        f"Unrecognized dataset: {name!r}. Valid: digits, synthetic, or a tfds "
        "catalog name such as mnist, cifar10, fashion_mnist.")
  try:
    with digits.tfds_temp_dirs_removed():
      builder = tfds.builder(name, data_dir=data_dir)
      builder.download_and_prepare()
  except Exception as e:  # tfds raises many types for a failed download.
    raise TfdistError(f"could not prepare tfds dataset {name!r} in "
                      f"{data_dir}: {errors.first_line(e, 200)}") from None
  return builder


def load(config) -> sources.Dataset:
  """Resolves `config.dataset`, preparing `digits` offline on first use."""
  tfds.disable_progress_bar()
  if config.dataset == "synthetic":
    return _synthetic(config.synthetic_shape, config.synthetic_classes,
                      config.seed)
  data_dir = os.path.expanduser(config.data_dir)
  if config.dataset == "digits":
    logging.info("Loading digits from %s (prepared offline on first use).",
                 data_dir)
    return _from_builder(digits.prepare(data_dir))
  return _from_builder(_catalog_builder(config.dataset, data_dir))
