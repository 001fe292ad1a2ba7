"""The train input function: tfdist's own pipeline of train batches
(tfdist.data.inputs wraps it in what the Trainer is handed)."""

import functools

from absl import logging
import tensorflow as tf

from tfdist.data import cache as cache_lib
from tfdist.data import order
from tfdist.data import randomness
from tfdist.data import sharding as sharding_lib
from tfdist.data import sources

SHUFFLE_BUFFER = 10_000


def _in_one_tensor(dataset, num_examples):
  """Whether one epoch fits one batch: few examples (the shuffle buffer
  held them all anyway), each a dense tensor of fixed shape."""
  specs = tf.nest.flatten(dataset.element_spec)
  return num_examples <= SHUFFLE_BUFFER and all(
      isinstance(spec, tf.TensorSpec) and spec.shape.is_fully_defined()
      for spec in specs)


def _own_batches(items, *, prepare, seed, stream, start, batch_size,
                 slice_of=(1, 0)):
  """Batches of `items` (the stream `stream` from its position `start`
  on) made ready by `prepare` (a parse, or None) and the augment.
  `slice_of` (hosts, host): every host reads this one stream and keeps
  its batches k * hosts + host, taken before anything is parsed or
  augmented, so that hosts do not each spend the CPU of all of them."""
  hosts, host = slice_of
  positioned = items.enumerate(start)
  if hosts > 1:
    # A filter, not batch-shard-unbatch: examples may differ in shape
    # until the augment makes them one.
    positioned = positioned.filter(
        lambda position, _: (position - start) // batch_size % hosts == host)
  parse, augment = prepare
  if parse is None and augment is None:
    examples = positioned.map(lambda _, item: item)
  else:
    # Stateful draws: each host's slice draws apart (keyed draws are the
    # one stream's, the same on every host).
    drawn = randomness.draw(augment, seed=seed, stream=stream, start=start,
                            apart=host)
    examples = positioned.map(
        lambda position, item: drawn(position, parse(item) if parse
                                     else item),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return examples.batch(batch_size, drop_remainder=True)


def _batches(source, num_examples, seed, start_example, batch_size,
             augment=None, buffer=SHUFFLE_BUFFER, *, stream=0,
             epoch_length=None, slice_of=(1, 0)):
  """Batches of `batch_size` examples, epoch after epoch, each epoch
  shuffled with its own seed, from example `start_example` on (a batch
  may span two epochs). An epoch is the first `epoch_length` examples of
  its shuffle (all of them by default); `stream` keys augmentation;
  `slice_of` as _own_batches.

  Jumping to an epoch is free, so resuming costs at most one epoch of
  skipping however long the run already was. A small epoch is kept as one
  cached tensor and permuted whole (one gather per epoch): shuffling it
  example by example cost 0.98 ms of CPU per batch of 256 digits inside a
  tf.function loop, 12% of a 2-core host at the MLP's step rate
  (docs/benchmarks.md, "The CLI a user runs").
  """
  epoch_length = epoch_length or num_examples
  first_epoch, offset = divmod(start_example, epoch_length)
  base = source()
  epochs = tf.data.Dataset.range(first_epoch, order.FOREVER)
  if augment is None and _in_one_tensor(base, num_examples):
    whole = base.batch(num_examples, drop_remainder=True).cache().repeat()

    def permuted(epoch, examples):
      seed_pair = tf.stack([randomness.seed_of(seed, epoch), tf.constant(
          0, tf.int64)])
      order_ = tf.random.experimental.stateless_shuffle(
          tf.range(num_examples), seed=seed_pair)
      start = tf.where(epoch == first_epoch, offset, 0)
      return tf.nest.map_structure(
          lambda t: tf.gather(t, order_[start:epoch_length]), examples)

    batches = tf.data.Dataset.zip(epochs, whole).map(permuted).rebatch(
        batch_size, drop_remainder=True)
    return batches.shard(*slice_of) if slice_of[0] > 1 else batches

  buffer = min(num_examples, buffer)

  def one_epoch(epoch):
    shuffled = randomness.shuffle(base, buffer, randomness.seed_of(seed, epoch))
    if epoch_length == num_examples:
      return shuffled
    # Read to the end, keep the first epoch_length: a cache that is not
    # read to its end is thrown away by TF, every epoch.
    return shuffled.enumerate().filter(
        lambda index, _: index < epoch_length).map(lambda _, e: e)

  return _own_batches(epochs.flat_map(one_epoch).skip(offset),
                      prepare=(None, augment), seed=seed, stream=stream,
                      start=start_example, batch_size=batch_size,
                      slice_of=slice_of)


def _stream_batches(dataset, seed, start_example, batch_size, buffer,
                    slice_of, own_files=(1, 0)):
  """A user's pipeline over files of unknown size: epochs end when its
  files do, so a resume reads its way to `start_example`. Without a
  seed (asynchronous workers, each in an order of its own) there is no
  place to get back to: nothing is skipped. `own_files` (hosts, host):
  only that host's files of the pipeline (file sharding)."""
  if seed is None:
    start_example = 0
  if start_example:
    logging.warning("%s: resuming reads %d examples again to get back to "
                    "where training stopped (tfdist.FileData resumes "
                    "without rereading).", dataset.name, start_example)

  def one_epoch(epoch):
    source = dataset.train_source()
    if own_files[0] > 1:
      source = sharding_lib.files_of_host(source, *own_files)
    return randomness.shuffle(source, buffer, randomness.seed_of(seed, epoch))
  examples = tf.data.Dataset.range(order.FOREVER).flat_map(one_epoch)
  return _own_batches(examples.skip(start_example),
                      prepare=(None, dataset.augment), seed=seed,
                      stream=own_files[1], start=start_example,
                      batch_size=batch_size, slice_of=slice_of)


def _planned_batches(dataset, seed, hosts, host, start_example, batch_size,
                     buffer, slice_of=(1, 0), place=None):
  """A split streamed from its files in tfdist.data.order's plan: pipeline
  `host` of `hosts` (file sharding), or the one stream (hosts 1) of which
  this host keeps `slice_of`. `place`: where `start_example` is, worked
  out beforehand (in a traced dataset function it cannot be)."""
  split = dataset.file_split
  if place is None and seed is not None:
    place = order.place(split, seed=seed, hosts=hosts, host=host,
                        position=start_example, window=buffer)
  records = order.records(split, seed=seed, hosts=hosts, host=host,
                          window=buffer, start=place)
  # Hosts that read streams of their own draw apart.
  return _own_batches(records, prepare=(split.parse, dataset.augment),
                      seed=seed, stream=host if hosts > 1 else 0,
                      start=start_example, batch_size=batch_size,
                      slice_of=slice_of)


def train_input_fn(dataset: sources.Dataset, *, global_batch_size, seed,
                   start_step=0, sharding="batch", cache="auto",
                   shuffle_buffer=SHUFFLE_BUFFER, workers=None,
                   resolved_for=None):
  """Returns an input_fn for `distribute_datasets_from_function`.

  `batch`: every host reads the whole stream and keeps its slice of each
  global batch, so global batch k is the same on any number of hosts.
  `file`: each host reads only its own files (1/N of the bytes), in its own
  shuffled epochs; a global batch depends on the host count.
  Either way, resuming at `start_step` skips the batches already trained
  on, so no example repeats within an epoch. `seed=None` gives each input
  pipeline its own order (asynchronous PS workers). `workers`: that many
  asynchronous workers, each reading its own files (`file` on streamed
  files), from its share of the examples before `start_step`.
  `resolved_for`: the host count `sharding` was already resolved for
  (by inputs_from_dataset), so it is not worked out, or probed, again.
  """
  policy = cache_lib.Policy.of(dataset, cache)
  if workers:
    return _worker_input_fn(dataset, seed, workers,
                            start_step * global_batch_size // workers,
                            global_batch_size, shuffle_buffer)

  def input_fn(context):
    hosts, host = context.num_input_pipelines, context.input_pipeline_id
    per_host = global_batch_size // hosts
    mode = sharding if hosts == resolved_for else (
        sharding_lib.resolve_sharding(dataset, sharding, hosts, seed=seed,
                                      streamed=policy.planned))
    if mode == "file":
      per_replica = context.get_per_replica_batch_size(global_batch_size)
      batches = _file_batches(dataset, policy, seed, hosts, host,
                              start_step * per_host, per_host,
                              shuffle_buffer)
      batches = sharding_lib.to_per_replica(
          batches, per_host, per_replica).prefetch(tf.data.AUTOTUNE)
    else:
      batches = sharding_lib.host_slice(_all_batches(
          dataset, policy, seed, start_step * global_batch_size, per_host,
          shuffle_buffer, cache_lib.host_name("train", host, hosts),
          (hosts, host)), context, per_host, None, sliced=True)
    # Epochs go on for ever; saying so lets a multi-worker iterator skip
    # its per-step "any data left?" all-reduce, and lets runners.SyncRunner
    # use a plain iterator.
    return batches.apply(tf.data.experimental.assert_cardinality(
        tf.data.INFINITE_CARDINALITY))
  return input_fn


def _worker_input_fn(dataset, seed, workers, start, batch_size, buffer):
  """File sharding on asynchronous (parameter-server) workers. TF traces
  the dataset function once for all of them, so it builds every worker's
  stream, and each worker runs its own (TF's worker index); where each
  starts is worked out here, eagerly, as a trace cannot."""
  places = [order.place(dataset.file_split, seed=seed, hosts=workers,
                        host=worker, position=start, window=buffer)
            for worker in range(workers)]

  def input_fn(context):
    streams = [functools.partial(
        _planned_batches, dataset, seed, workers, worker, start, batch_size,
        buffer, place=places[worker]) for worker in range(workers)]
    index = tf.distribute.coordinator.experimental_get_current_worker_index()
    batches = sharding_lib.to_per_replica(
        tf.switch_case(tf.cast(index, tf.int32), streams), batch_size,
        context.get_per_replica_batch_size(batch_size))
    return batches.prefetch(tf.data.AUTOTUNE).apply(
        tf.data.experimental.assert_cardinality(
            tf.data.INFINITE_CARDINALITY))
  return input_fn


def _file_batches(dataset, policy, seed, hosts, host, start, per_host,
                  buffer):
  """This host's batches from its own files only."""
  if policy.planned:
    return _planned_batches(dataset, seed, hosts, host, start, per_host,
                            buffer)
  if dataset.train_files is None:  # A pipeline built by hand.
    return _stream_batches(dataset, seed, start, per_host, buffer, (1, 0),
                           own_files=(hosts, host))
  source, num_examples = dataset.train_files(hosts, host)
  # Every host's epoch is as long as the shortest host's, so that hosts
  # stay in the same epoch (each leaves out other examples each epoch).
  shortest = min(sharding_lib.host_sizes(dataset, hosts))
  return _batches(policy.source(dataset, source,
                                cache_lib.host_name("train", host, hosts)),
                  num_examples, seed, start, per_host, dataset.augment,
                  buffer, stream=host, epoch_length=shortest)


def _all_batches(dataset, policy, seed, start, per_host, buffer,
                 cache_name, slice_of):
  """This host's `slice_of` the per-host batches of the whole stream,
  which every host reads."""
  if policy.planned:
    return _planned_batches(dataset, seed, 1, 0, start, per_host, buffer,
                            slice_of)
  if dataset.num_train_examples is None:
    return _stream_batches(dataset, seed, start, per_host, buffer, slice_of)
  return _batches(policy.source(dataset, dataset.train_source, cache_name),
                  dataset.num_train_examples, seed, start, per_host,
                  dataset.augment, buffer, slice_of=slice_of)
