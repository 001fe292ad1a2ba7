"""Input pipelines, and the built-in datasets: `digits` (offline),
`synthetic`, and tfds image catalog names.

A Dataset holds unbatched (features, labels) or (features, labels,
sample_weight) examples per split, where features is a tensor or a dict of
tensors. The input functions here do the shuffling, epochs, host sharding,
per-replica batching and resume skip: train batches are the examples
batched; eval batches are (features, labels, mask) or (features, labels,
mask, sample_weight), where the mask is 0 on padding examples so that eval
counts each real example exactly once.
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
_FOREVER = 2**62


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Unbatched (features, labels) examples: a source per split.

  `input_shape` and `num_classes` are set for the built-in image
  classification data; user data leaves them None.
  """

  name: str
  num_train_examples: int
  num_test_examples: Optional[int]  # None: infinite (synthetic).
  train_source: Callable[[], tf.data.Dataset]
  test_source: Callable[[], tf.data.Dataset]
  input_shape: Optional[Tuple[int, ...]] = None
  num_classes: Optional[int] = None
  # Data read from files: (num_hosts, host_id) -> (source, num_examples) of
  # that host's own files (--input_sharding=file). None: not from files.
  train_files: Optional[Callable[[int, int], Tuple[Callable, int]]] = None
  num_train_files: int = 0


def _count(dataset):
  size = int(dataset.cardinality())
  if size >= 0:
    return size
  if size == int(tf.data.INFINITE_CARDINALITY):
    return None
  return int(dataset.reduce(0, lambda count, _: count + 1))


def from_user(name, train, test):
  """A Dataset from two unbatched tf.data.Datasets of (features, labels)
  or (features, labels, sample_weight)."""
  for split, dataset in (("train", train), ("eval", test)):
    if not isinstance(dataset, tf.data.Dataset):
      raise ConfigError(f"{name} must return (train, eval) tf.data.Datasets; "
                        f"its {split} part is a {type(dataset).__name__}.")
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) in (2, 3)):
      raise ConfigError(f"{name}: each {split} example must be (features, "
                        f"labels) or (features, labels, sample_weight). "
                        f"Received: element_spec={spec}")
    if len(spec) == 3 and not (
        isinstance(spec[2], tf.TensorSpec) and spec[2].dtype.is_floating
        and spec[2].shape.rank == 0):
      raise ConfigError(f"{name}: a {split} example's sample_weight must be "
                        f"one float (a scalar). Received: {spec[2]}")
  num_train = _count(train)
  if not num_train:
    raise ConfigError(f"{name}: the train split must be finite and not "
                      f"empty. Received: {num_train} examples")
  return Dataset(name=name, num_train_examples=num_train,
                 num_test_examples=_count(test),
                 train_source=_portable_source(train, f"{name} (train)"),
                 test_source=_portable_source(test, f"{name} (eval)"))


_WARN, _FAIL = 0, 2  # DatasetToGraphV2's external_state_policy values.


def _portable_source(dataset, name):
  """A source of `dataset` that any task of the cluster can call.

  A dataset made in this process (numpy arrays, say) is a handle to state
  in this process only. Called eagerly, the source returns it, cached.
  Called while a function is traced (a parameter-server worker's dataset
  function, which is shipped to other processes), it returns the dataset
  rebuilt from its serialized graph, which carries the arrays with it.
  """
  cached = dataset.cache()
  graph = []

  def to_graph(policy):
    return tf.raw_ops.DatasetToGraphV2(
        input_dataset=dataset._variant_tensor,  # pylint: disable=protected-access
        external_state_policy=policy, strip_device_assignment=True)

  def serialized():
    if not graph:
      with tf.init_scope():  # Serialize eagerly, once, in this process.
        try:
          graph.append(to_graph(_FAIL))
        except tf.errors.FailedPreconditionError as e:
          logging.warning(
              "%s holds state of this process (%s); other tasks get a "
              "fresh copy of it.", name, str(e).splitlines()[0][:160])
          graph.append(to_graph(_WARN))
    return graph[0]

  def source():
    if tf.executing_eagerly():
      return cached
    return tf.data.experimental.from_variant(
        tf.raw_ops.DatasetFromGraph(graph_def=serialized()),
        dataset.element_spec).cache()
  return source


def features_spec(dataset: Dataset):
  return dataset.train_source().element_spec[0]


def sample_batch(dataset: Dataset, size=2):
  """A few (features, labels), batched: to check a model against the
  data."""
  return tuple(next(iter(dataset.train_source().batch(size).take(1)))[:2])


def _normalize(image, label):
  return tf.cast(image, tf.float32) / 255.0, tf.cast(label, tf.int32)


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
            _normalize, num_parallel_calls=tf.data.AUTOTUNE).cache()

  shard_lengths = splits["train"].shard_lengths

  def train_files(num_hosts, host_id):
    # tfds gives host i files i, i + num_hosts, ... (its FILE sharding).
    context = tf.distribute.InputContext(num_input_pipelines=num_hosts,
                                         input_pipeline_id=host_id)
    return (source("train", context),
            sum(shard_lengths[host_id::num_hosts]))

  return Dataset(
      train_files=train_files, num_train_files=len(shard_lengths),
      name=builder.name, input_shape=tuple(features["image"].shape),
      num_classes=features["label"].num_classes,
      num_train_examples=splits["train"].num_examples,
      num_test_examples=splits[test_split].num_examples,
      train_source=source("train"), test_source=source(test_split))


def _synthetic(shape, num_classes, seed, size=1024):
  def source():
    images = tf.random.stateless_uniform((size,) + tuple(shape), (seed, 1))
    labels = tf.random.stateless_uniform((size,), (seed, 2), maxval=num_classes,
                                         dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices((images, labels)).cache()
  return Dataset(name="synthetic", input_shape=tuple(shape),
                 num_classes=num_classes, num_train_examples=size,
                 num_test_examples=None,
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


def _host_slice(batches, context, per_host, finish_batch):
  """Cuts a stream of per-host batches into this host's per-replica
  batches.

  Global batch k is the same examples whatever the number of hosts and
  replicas: host i takes per-host batch k * num_hosts + i.
  """
  hosts = context.num_input_pipelines
  if hosts > 1:
    batches = batches.shard(hosts, context.input_pipeline_id)
  if context.num_replicas_in_sync > hosts:
    batches = batches.rebatch(context.get_per_replica_batch_size(
        per_host * hosts))
  if finish_batch is not None:
    # Per-batch, not per-example, maps: a per-example map costs ~20x here.
    batches = batches.map(finish_batch, num_parallel_calls=tf.data.AUTOTUNE,
                          deterministic=True)
  return batches.prefetch(tf.data.AUTOTUNE)


def _unit_mask(features, labels, *sample_weight):
  size = tf.shape(tf.nest.flatten(labels)[0])[0]
  return (features, labels, tf.ones([size], tf.float32), *sample_weight)


def _epoch_seed(seed, epoch):
  if seed is None:
    # The function is traced once and shipped to every worker, so any
    # graph-level seed is shared; the clock on each worker is not.
    return tf.cast(tf.timestamp() * 1e6, tf.int64) + epoch
  return seed * 1_000_003 + epoch


def _in_one_tensor(dataset, num_examples):
  """Whether one epoch fits one batch: few examples (the shuffle buffer
  held them all anyway), each a dense tensor of fixed shape."""
  specs = tf.nest.flatten(dataset.element_spec)
  return num_examples <= SHUFFLE_BUFFER and all(
      isinstance(spec, tf.TensorSpec) and spec.shape.is_fully_defined()
      for spec in specs)


def _batches(source, num_examples, seed, start_example, batch_size):
  """Batches of `batch_size` examples, epoch after epoch, each epoch
  shuffled with its own seed, from example `start_example` on (a batch
  may span two epochs).

  Jumping to an epoch is free, so resuming costs at most one epoch of
  skipping however long the run already was. A small epoch is kept as one
  cached tensor and permuted whole (one gather per epoch): shuffling it
  example by example cost 0.98 ms of CPU per batch of 256 digits inside a
  tf.function loop, 12% of a 2-core host at the MLP's step rate
  (docs/benchmarks.md, "The CLI a user runs").
  """
  first_epoch, offset = divmod(start_example, num_examples)
  base = source()
  epochs = tf.data.Dataset.range(first_epoch, _FOREVER)
  if _in_one_tensor(base, num_examples):
    whole = base.batch(num_examples, drop_remainder=True).cache().repeat()

    def permuted(epoch, examples):
      seed_pair = tf.stack([_epoch_seed(seed, epoch), tf.constant(
          0, tf.int64)])
      order = tf.random.experimental.stateless_shuffle(
          tf.range(num_examples), seed=seed_pair)
      start = tf.where(epoch == first_epoch, offset, 0)
      return tf.nest.map_structure(
          lambda t: tf.gather(t, order[start:]), examples)

    return tf.data.Dataset.zip(epochs, whole).map(permuted).rebatch(
        batch_size, drop_remainder=True)

  buffer = min(num_examples, SHUFFLE_BUFFER)

  def one_epoch(epoch):
    return base.shuffle(buffer, seed=_epoch_seed(seed, epoch))

  return epochs.flat_map(one_epoch).skip(offset).batch(
      batch_size, drop_remainder=True)


def resolve_sharding(dataset: Dataset, sharding, num_hosts):
  """`batch` or `file` for --input_sharding=`sharding` on `num_hosts`."""
  if sharding == "auto":
    return "file" if num_hosts > 1 and (
        dataset.num_train_files >= num_hosts) else "batch"
  if sharding == "file" and dataset.num_train_files < num_hosts:
    raise ConfigError(
        f"--input_sharding=file gives each of the {num_hosts} hosts its own "
        f"files, but {dataset.name} has {dataset.num_train_files} train "
        "file(s). Use --input_sharding=batch (or auto). Received: "
        f"input_sharding=file with {num_hosts} hosts")
  return sharding


def train_input_fn(dataset: Dataset, *, global_batch_size, seed, start_step=0,
                   sharding="batch"):
  """Returns an input_fn for `distribute_datasets_from_function`.

  `batch`: every host reads the whole stream and keeps its slice of each
  global batch, so global batch k is the same on any number of hosts.
  `file`: each host reads only its own files (1/N of the bytes), in its own
  shuffled epochs; a global batch depends on the host count.
  Either way, resuming at `start_step` skips the batches already trained
  on, so no example repeats within an epoch. `seed=None` gives each input
  pipeline its own order (asynchronous PS workers).
  """
  def input_fn(context):
    hosts = context.num_input_pipelines
    per_host = global_batch_size // hosts
    if resolve_sharding(dataset, sharding, hosts) == "batch":
      batches = _host_slice(
          _batches(dataset.train_source, dataset.num_train_examples, seed,
                   start_step * global_batch_size, per_host),
          context, per_host, None)
    else:
      source, num_examples = dataset.train_files(hosts,
                                                 context.input_pipeline_id)
      per_replica = context.get_per_replica_batch_size(global_batch_size)
      batches = _batches(source, num_examples, seed, start_step * per_host,
                         per_host).rebatch(per_replica).prefetch(
                             tf.data.AUTOTUNE)
    # Epochs go on for ever; saying so lets a multi-worker iterator skip
    # its per-step "any data left?" all-reduce, and lets runners.SyncRunner
    # use a plain iterator.
    return batches.apply(tf.data.experimental.assert_cardinality(
        tf.data.INFINITE_CARDINALITY))
  return input_fn


def eval_steps(dataset: Dataset, *, global_batch_size, requested=0):
  """Number of eval batches: one full pass unless `requested` caps it."""
  if dataset.num_test_examples is None:
    return requested or SYNTHETIC_EVAL_STEPS
  full = math.ceil(dataset.num_test_examples / global_batch_size)
  return min(requested, full) if requested else full


def eval_input_fn(dataset: Dataset, *, global_batch_size):
  """Pads the test split with masked (mask 0) examples to whole global
  batches."""
  num_real = dataset.num_test_examples

  def real_mask(indices, batch):
    features, labels, *sample_weight = batch
    return (features, labels, tf.cast(indices < num_real, tf.float32),
            *sample_weight)

  def input_fn(context):
    per_host = global_batch_size // context.num_input_pipelines
    source = dataset.test_source()
    if num_real is None:
      return _host_slice(source.repeat().batch(per_host, drop_remainder=True),
                         context, per_host, _unit_mask)
    # Padding repeats real examples (any structure fits), masked.
    padding = (-num_real) % global_batch_size
    blank = source.repeat().take(padding)
    return _host_slice(source.concatenate(blank).enumerate().batch(
        per_host, drop_remainder=True), context, per_host, real_mask)
  return input_fn


@dataclasses.dataclass(frozen=True)
class Inputs:
  """Where a run's batches come from: input functions for
  `distribute_datasets_from_function`, made per start step."""

  name: str
  train_fn: Callable  # (start_step, seed or None) -> input_fn
  eval_fn: Callable  # () -> input_fn
  eval_steps: int
  sample: Tuple  # A few (features, labels) examples, batched.
  features_spec: object  # One example's features (no batch dimension).
  image_input: bool = False  # The export names a single input "images".


def inputs_from_dataset(dataset: Dataset, *, global_batch_size,
                        eval_steps_requested=0, sharding="batch",
                        num_hosts=1) -> Inputs:
  """tfdist's own pipeline over unbatched examples."""
  mode = resolve_sharding(dataset, sharding, num_hosts)
  if num_hosts > 1:
    logging.info("Input sharding: %s: %s.", mode, (
        f"every host reads all {dataset.num_train_files or 'the'} train "
        "file(s) and keeps its slice of each global batch"
        if mode == "batch" else
        f"each host reads only its own files, 1/{num_hosts} of "
        f"{dataset.num_train_files}"))
  return Inputs(
      name=dataset.name,
      train_fn=lambda start_step, seed: train_input_fn(
          dataset, global_batch_size=global_batch_size, seed=seed,
          start_step=start_step, sharding=mode),
      eval_fn=lambda: eval_input_fn(dataset,
                                    global_batch_size=global_batch_size),
      eval_steps=eval_steps(dataset, global_batch_size=global_batch_size,
                            requested=eval_steps_requested),
      sample=sample_batch(dataset), features_spec=features_spec(dataset),
      image_input=dataset.input_shape is not None)


def inputs_from_task(task, *, global_batch_size,
                     eval_steps_requested) -> Inputs:
  """A task's own per-replica pipelines (full control)."""
  if not callable(getattr(task, "eval_input", None)):
    raise ConfigError(f"{task.display_name} defines train_input; it must "
                      "define eval_input(context) too.")
  if not eval_steps_requested:
    raise ConfigError(f"{task.display_name} makes its own input, so tfdist "
                      "cannot count its eval batches: set --eval_steps.")
  probe = task.train_input(
      tf.distribute.InputContext(), global_batch_size=global_batch_size,
      seed=0, start_step=0)
  first = next(iter(probe.take(1)), None)
  if first is None:
    raise ConfigError(f"{task.display_name}.train_input gave no batch: is "
                      "its source empty?")
  features, labels = first[0], first[1]
  unbatched = tf.nest.map_structure(
      lambda t: tf.TensorSpec(t.shape[1:], t.dtype), features)
  return Inputs(
      name=f"{task.display_name}.train_input",
      train_fn=lambda start_step, seed: (
          lambda context: task.train_input(
              context, global_batch_size=global_batch_size, seed=seed,
              start_step=start_step)),
      eval_fn=lambda: (lambda context: task.eval_input(
          context, global_batch_size=global_batch_size)),
      eval_steps=eval_steps_requested,
      sample=(features, labels), features_spec=unbatched)
