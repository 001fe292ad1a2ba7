"""The eval input: the test split padded with masked examples to whole
global batches, so that eval counts each real example exactly once. A
split streamed from its files, on several hosts, is read by file: each
host reads only its own files (about 1/N of the bytes), padded to as many
batches as the host with the most records needs."""

import heapq
import math

import tensorflow as tf

from tfdist.data import cache as cache_lib
from tfdist.data import order
from tfdist.data import sharding as sharding_lib
from tfdist.data import sources

SYNTHETIC_EVAL_STEPS = 10
# Eval reads by file when that pads at most this share of batches more
# than reading by batch would (or one batch, for a small eval).
MAX_EXTRA_EVAL_STEPS = 0.02


def _unit_mask(features, labels, *sample_weight):
  size = tf.shape(tf.nest.flatten(labels)[0])[0]
  return (features, labels, tf.ones([size], tf.float32), *sample_weight)


def eval_steps(dataset: sources.Dataset, *, global_batch_size, requested=0,
               num_hosts=1, cache="auto"):
  """Number of eval batches: one full pass unless `requested` caps it.
  `num_hosts` and `cache` must be eval_input_fn's (inputs_from_dataset
  gives both the same)."""
  if dataset.num_test_examples is None:
    return requested or SYNTHETIC_EVAL_STEPS
  full = by_file_steps(dataset, global_batch_size, num_hosts, cache) or (
      math.ceil(dataset.num_test_examples / global_batch_size))
  return min(requested, full) if requested else full


def eval_files_of_hosts(counts, hosts):
  """[[file index, ...] of each host]: each file, the largest first, to
  the host with the fewest records so far (the same on every host)."""
  owned, fewest = [[] for _ in range(hosts)], [(0, h) for h in range(hosts)]
  for index in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
    size, host = heapq.heappop(fewest)
    owned[host].append(index)
    heapq.heappush(fewest, (size + counts[index], host))
  return [sorted(files) for files in owned]


def _policy(dataset, cache):
  # Eval is rebuilt for every evaluation: a memory cache would be filled
  # again each time, so `auto` streams it.
  return cache_lib.Policy.of(dataset, "off" if cache == "auto" else cache)


def by_file_steps(dataset, global_batch_size, hosts, cache):
  """The eval batches when each of `hosts` reads its own files, or None
  where every host reads the split (one host, a split not streamed from
  files, fewer files than hosts, or hosts too uneven)."""
  split = dataset.eval_split
  if hosts < 2 or split is None or len(split.paths) < hosts or (
      _policy(dataset, cache).cache != "off"):
    return None
  per_host = global_batch_size // hosts
  steps = max(math.ceil(sum(split.counts[i] for i in files) / per_host)
              for files in eval_files_of_hosts(split.counts, hosts))
  by_batch = math.ceil(split.num_examples / global_batch_size)
  return steps if steps - by_batch <= max(
      1, MAX_EXTRA_EVAL_STEPS * by_batch) else None


def eval_input_fn(dataset: sources.Dataset, *, global_batch_size,
                  cache="auto", num_hosts=1):
  """Pads the test split with masked (mask 0) examples to whole global
  batches. A split read from files is streamed unless --cache says
  otherwise: on the `num_hosts` hosts eval_steps was counted for (give
  both the same `num_hosts` and `cache`), each reads its own files where
  it can (by_file_steps), else every host reads it whole, in file order,
  and parses its batches only."""
  num_real = dataset.num_test_examples
  policy = _policy(dataset, cache)

  def real_mask(indices, batch):
    features, labels, *sample_weight = batch
    return (features, labels, tf.cast(indices < num_real, tf.float32),
            *sample_weight)

  def input_fn(context):
    hosts, per_host = context.num_input_pipelines, (
        global_batch_size // context.num_input_pipelines)
    by_file = hosts == num_hosts and by_file_steps(
        dataset, global_batch_size, hosts, cache)
    if by_file:
      return _own_files_eval(dataset.eval_split, by_file, per_host, context)
    source = policy.source(
        dataset, dataset.test_source,
        cache_lib.host_name("eval", context.input_pipeline_id, hosts))()
    if num_real is None:
      return sharding_lib.host_slice(
          source.repeat().batch(per_host, drop_remainder=True), context,
          per_host, _unit_mask)
    # Padding repeats real examples (any structure fits), masked.
    padding = (-num_real) % global_batch_size
    if dataset.eval_split is not None and policy.cache == "off":
      return sharding_lib.host_slice(_streamed_eval(
          dataset.eval_split, padding, per_host, context), context, per_host,
                                     real_mask, sliced=True)
    blank = source.repeat().take(padding)
    return sharding_lib.host_slice(source.concatenate(blank).enumerate().batch(
        per_host, drop_remainder=True), context, per_host, real_mask)
  return input_fn


def _own_files_eval(split, steps, per_host, context):
  """This host's files of the split (eval_files_of_hosts), masked
  padding after them to `steps` batches."""
  mine = eval_files_of_hosts(split.counts, context.num_input_pipelines)[
      context.input_pipeline_id]
  own = sum(split.counts[i] for i in mine)
  # Every host owns a file (by_file_steps needs as many files as hosts).
  records = order.interleave(
      tf.constant([split.paths[i] for i in mine]),
      tf.zeros([len(mine)], tf.int64), split)
  # Padding repeats the split's first records, masked.
  padded = records.concatenate(split.records().repeat().take(
      steps * per_host - own))

  def masked(index, record):
    features, labels, *sample_weight = split.parse(record)
    return (features, labels, tf.cast(index < own, tf.float32),
            *sample_weight)
  batches = padded.enumerate().map(
      masked, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).batch(
          per_host, drop_remainder=True)
  return sharding_lib.host_slice(batches, context, per_host, None,
                                 sliced=True)


def _streamed_eval(split, padding, per_host, context):
  """(index, example) batches of this host's share of an eval split read
  from files: every host reads the records, but parses only the batches
  it keeps."""
  records = split.records()
  positioned = records.concatenate(records.repeat().take(padding)).enumerate()
  mine = positioned.batch(per_host, drop_remainder=True)
  if context.num_input_pipelines > 1:
    mine = mine.shard(context.num_input_pipelines, context.input_pipeline_id)
  return mine.unbatch().map(
      lambda index, record: (index, split.parse(record)),
      num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).batch(
          per_host, drop_remainder=True)
