"""The eval input: the test split padded with masked examples to whole
global batches, so that eval counts each real example exactly once."""

import math

import tensorflow as tf

from tfdist.data import cache as cache_lib
from tfdist.data import sharding as sharding_lib
from tfdist.data import sources

SYNTHETIC_EVAL_STEPS = 10


def _unit_mask(features, labels, *sample_weight):
  size = tf.shape(tf.nest.flatten(labels)[0])[0]
  return (features, labels, tf.ones([size], tf.float32), *sample_weight)


def eval_steps(dataset: sources.Dataset, *, global_batch_size, requested=0):
  """Number of eval batches: one full pass unless `requested` caps it."""
  if dataset.num_test_examples is None:
    return requested or SYNTHETIC_EVAL_STEPS
  full = math.ceil(dataset.num_test_examples / global_batch_size)
  return min(requested, full) if requested else full


def eval_input_fn(dataset: sources.Dataset, *, global_batch_size,
                  cache="auto"):
  """Pads the test split with masked (mask 0) examples to whole global
  batches. A split read from files is streamed unless --cache says
  otherwise: every host reads it whole, in file order."""
  num_real = dataset.num_test_examples
  # Eval is rebuilt for every evaluation: a memory cache would be filled
  # again each time, so `auto` streams it.
  policy = cache_lib.Policy.of(dataset, "off" if cache == "auto" else cache)

  def real_mask(indices, batch):
    features, labels, *sample_weight = batch
    return (features, labels, tf.cast(indices < num_real, tf.float32),
            *sample_weight)

  def input_fn(context):
    per_host = global_batch_size // context.num_input_pipelines
    source = policy.source(
        dataset, dataset.test_source,
        cache_lib.host_name("eval", context.input_pipeline_id,
                            context.num_input_pipelines))()
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
