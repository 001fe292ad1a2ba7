"""Datasets: `digits` (offline), `synthetic`, and tfds catalog names.

Every input function yields (images, labels, weights) batches of the
per-replica size. Padding examples carry weight 0, so eval counts each real
example exactly once.
"""

import dataclasses
import math
import os
from typing import Callable, Optional, Tuple

from absl import logging
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdist import digits
from tfdist.errors import ConfigError, TfdistError

SHUFFLE_BUFFER = 10_000
SYNTHETIC_EVAL_STEPS = 10


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A classification dataset: its shape and a source per split."""

  name: str
  input_shape: Tuple[int, ...]
  num_classes: int
  num_test_examples: Optional[int]  # None: infinite (synthetic).
  train_source: Callable[[], tf.data.Dataset]
  test_source: Callable[[], tf.data.Dataset]


def _normalize(image, label):
  return tf.cast(image, tf.float32) / 255.0, tf.cast(label, tf.int32)


def _from_builder(builder):
  features = builder.info.features
  splits = builder.info.splits
  test_split = "test" if "test" in splits else "validation"
  if "train" not in splits or test_split not in splits:
    raise ConfigError(f"dataset {builder.name!r} needs a train split and a "
                      f"test or validation split; it has {list(splits)}.")

  def source(split):
    return lambda: builder.as_dataset(
        split=split, as_supervised=True,
        read_config=tfds.ReadConfig(shuffle_seed=0)).map(
            _normalize, num_parallel_calls=tf.data.AUTOTUNE).cache()

  return Dataset(
      name=builder.name, input_shape=tuple(features["image"].shape),
      num_classes=features["label"].num_classes,
      num_test_examples=splits[test_split].num_examples,
      train_source=source("train"), test_source=source(test_split))


def _synthetic(shape, num_classes, seed):
  def source():
    images = tf.random.stateless_uniform((1024,) + tuple(shape), (seed, 1))
    labels = tf.random.stateless_uniform((1024,), (seed, 2), maxval=num_classes,
                                         dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices((images, labels)).cache()
  return Dataset(name="synthetic", input_shape=tuple(shape),
                 num_classes=num_classes, num_test_examples=None,
                 train_source=source, test_source=source)


def _catalog_builder(name, data_dir):
  if name not in tfds.list_builders():
    raise ConfigError(
        f"Unrecognized dataset: {name!r}. Valid: digits, synthetic, or a tfds "
        "catalog name such as mnist, cifar10, fashion_mnist.")
  builder = tfds.builder(name, data_dir=data_dir)
  try:
    builder.download_and_prepare()
  except Exception as e:  # tfds raises many types for a failed download.
    raise TfdistError(f"could not prepare tfds dataset {name!r} in "
                      f"{data_dir}: {str(e).splitlines()[0][:200]}") from None
  return builder


def load(config) -> Dataset:
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


def _host_slice(dataset, context, per_host, skip_batches=0):
  """Cuts the global stream into this host's per-replica batches.

  Global batch k is the same examples whatever the number of hosts and
  replicas: host i takes per-host batch k * num_hosts + i.
  """
  per_replica = context.get_per_replica_batch_size(
      per_host * context.num_input_pipelines)
  hosts = context.num_input_pipelines
  dataset = dataset.batch(per_host, drop_remainder=True)
  dataset = dataset.skip(skip_batches * hosts)
  dataset = dataset.shard(hosts, context.input_pipeline_id)
  return dataset.rebatch(per_replica).prefetch(tf.data.AUTOTUNE)


def _with_weights(dataset, weight=1.0):
  return dataset.map(lambda x, y: (x, y, tf.constant(weight, tf.float32)))


def train_input_fn(dataset: Dataset, *, global_batch_size, seed, start_step=0):
  """Returns an input_fn for `distribute_datasets_from_function`.

  Resuming at `start_step` skips the global batches already trained on, so a
  restarted run sees the same data as an uninterrupted one.
  """
  def input_fn(context):
    per_host = global_batch_size // context.num_input_pipelines
    source = dataset.train_source().shuffle(
        SHUFFLE_BUFFER, seed=seed, reshuffle_each_iteration=True).repeat()
    return _host_slice(_with_weights(source), context, per_host, start_step)
  return input_fn


def eval_steps(dataset: Dataset, *, global_batch_size, requested=0):
  """Number of eval batches: one full pass unless `requested` caps it."""
  if dataset.num_test_examples is None:
    return requested or SYNTHETIC_EVAL_STEPS
  full = math.ceil(dataset.num_test_examples / global_batch_size)
  return min(requested, full) if requested else full


def eval_input_fn(dataset: Dataset, *, global_batch_size):
  """Pads the test split with weight-0 examples to whole global batches."""
  def input_fn(context):
    per_host = global_batch_size // context.num_input_pipelines
    source = _with_weights(dataset.test_source())
    if dataset.num_test_examples is None:
      return _host_slice(source.repeat(), context, per_host)
    padding = (-dataset.num_test_examples) % global_batch_size
    blank = tf.data.Dataset.from_tensors(
        (tf.zeros(dataset.input_shape), tf.constant(0, tf.int32))).repeat(
            padding)
    return _host_slice(source.concatenate(_with_weights(blank, 0.0)),
                       context, per_host)
  return input_fn
