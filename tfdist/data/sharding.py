"""Which host reads what: `batch` (every host reads the whole stream and
keeps its slice of each global batch) or `file` (each host reads only its
own files)."""

import tensorflow as tf

from tfdist import errors
from tfdist.data import order
from tfdist.errors import ConfigError

# --input_sharding=auto shards by file when an epoch leaves out at most this
# share of the records (hosts whose files hold more than the shortest
# host's leave out the rest, other records each epoch).
MAX_LEFT_OUT = 0.02


def resolve_sharding(dataset, sharding, num_hosts, *, seed, streamed=False):
  """`batch` or `file` for --input_sharding=`sharding` on `num_hosts`.

  auto: `file` for data streamed from files when every host can have a
  file of its own and the run's first epochs (`seed`) leave out at most
  MAX_LEFT_OUT of the records, or for a pipeline built by hand in which
  TF's auto-shard rewrite finds a file for each host; `batch` otherwise,
  which keeps global batch k the same on any number of hosts (cached
  data costs nothing to read again).
  """
  if hand_built(dataset) and num_hosts > 1 and sharding != "batch":
    return _hand_built_sharding(dataset, sharding, num_hosts)
  if sharding == "auto":
    return "file" if streamed and num_hosts > 1 and (
        dataset.num_train_files >= num_hosts) and _left_out(
            dataset, num_hosts, seed) <= MAX_LEFT_OUT else "batch"
  if sharding == "file" and dataset.num_train_files < num_hosts:
    raise ConfigError(
        f"--input_sharding=file gives each of the {num_hosts} hosts its own "
        f"files, but {dataset.name} has {dataset.num_train_files} train "
        "file(s). Use --input_sharding=batch (or auto). Received: "
        f"input_sharding=file with {num_hosts} hosts")
  if sharding == "file" and not streamed and num_hosts > 1:
    _check_fixed_files(dataset, num_hosts)
  return sharding


def hand_built(dataset):
  """A user's own tf.data pipeline over files of unknown size (not a
  FileData): one of known size is read whole on every host, where a
  cache and an assert_cardinality of the user's hold."""
  return not dataset.in_memory and dataset.file_split is None and (
      dataset.train_files is None and dataset.num_train_examples is None)


def files_of_host(pipeline, hosts, host):
  """A hand-built `pipeline` that reads files, with host `host`'s files of
  `hosts` only: TF's own auto-shard rewrite, as experimental_distribute_
  dataset applies it (FILE policy), finds its list of files and deals it
  out. Private (tests/test_private_apis.py); imported here, so that a TF
  that moves it fails only this."""
  from tensorflow.python.data.experimental.ops import distribute as tf_distribute  # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.FILE)
  return tf_distribute._AutoShardDataset(  # pylint: disable=protected-access
      pipeline.with_options(options), hosts, host)


# What TF's rewrite raises when it cannot deal a pipeline's files out: no
# file source it knows (NotFound), or fewer files than hosts. Any other
# error (a read that failed) is raised, so that hosts never decide apart.
_UNSHARDABLE = (tf.errors.NotFoundError, tf.errors.InvalidArgumentError)


def _hand_built_sharding(dataset, sharding, num_hosts):
  """`file` when TF's rewrite finds at least a file per host (tried on
  host 0, which fails when there are fewer), `batch` for auto otherwise;
  `file` refused in one line."""
  try:
    for _ in files_of_host(dataset.train_source(), num_hosts, 0).take(1):
      pass
    return "file"
  except (*_UNSHARDABLE, ImportError, AttributeError) as e:
    if sharding == "auto":
      return "batch"
    raise ConfigError(
        f"--input_sharding=file: TF's auto-shard rewrite cannot deal "
        f"{dataset.name}'s files out to {num_hosts} hosts ("
        f"{errors.first_line(e, 200)}). Use --input_sharding=batch (or "
        f"auto), or a tfdist.FileData. Received: input_sharding=file with "
        f"{num_hosts} hosts") from None


def _fixed_left_out(dataset, num_hosts):
  """The share an epoch leaves out when each host keeps its files (a
  host's epoch is the shortest host's)."""
  sizes = host_sizes(dataset, num_hosts)
  return 1 - num_hosts * min(sizes) / sum(sizes)


def host_sizes(dataset, num_hosts):
  """Examples in each host's own files (cached data, file sharding)."""
  return [dataset.train_files(num_hosts, host)[1]
          for host in range(num_hosts)]


def _check_fixed_files(dataset, num_hosts):
  """Cached data keeps each host's files for the whole run, and a host's
  epoch is as long as the shortest host's: a host with more examples
  samples each of them less often. Refused past MAX_LEFT_OUT."""
  sizes = host_sizes(dataset, num_hosts)
  left_out = 1 - num_hosts * min(sizes) / sum(sizes)
  if left_out > MAX_LEFT_OUT:
    raise ConfigError(
        f"--input_sharding=file on cached data gives each host the same "
        f"files every epoch, and hosts holding {min(sizes)} to {max(sizes)} "
        f"examples would sample {left_out:.1%} of {dataset.name}'s examples "
        f"less often than the rest (at most {MAX_LEFT_OUT:.0%}). Use "
        "--cache=off (files dealt anew each epoch) or --input_sharding=batch."
        f" Received: input_sharding=file on {num_hosts} hosts")


def _left_out(dataset, num_hosts, seed):
  split = dataset.file_split
  return (order.left_out_share(split.counts, num_hosts, seed) if split
          else 0.0)


def describe(dataset, mode, sharding, num_hosts, streamed, seed):
  """The log line's reason for the sharding a run uses."""
  files = dataset.num_train_files
  if mode == "file" and hand_built(dataset):
    return ("each host reads only its own files of this hand-built "
            "pipeline (dealt out by TF's auto-shard rewrite); tfdist does "
            "not know their sizes, so hosts' epochs may differ in length, "
            "and a global batch depends on the number of hosts")
  if mode == "file":
    left_out = (_left_out(dataset, num_hosts, seed) if streamed
                else _fixed_left_out(dataset, num_hosts))
    return (f"each host reads only its own files, about 1/{num_hosts} of "
            f"{files}" + (
                f"; each epoch leaves out about {left_out:.1%} of the "
                "records, other ones each epoch (a host's epoch is as long "
                "as the shortest host's)" if left_out else ""))
  why = ""
  if sharding == "auto":
    if not streamed:
      why = (" (the data is in memory or cached)" if dataset.file_split
             or dataset.in_memory else " (a dataset built by hand in "
             "which TF's auto-shard rewrite finds fewer files than hosts, "
             "or none)")
    elif files < num_hosts:
      why = (f" ({files} train file(s) for {num_hosts} hosts: too few for "
             "one each)")
    else:
      why = (f" (by file, {files} files on {num_hosts} hosts would leave "
             f"out {_left_out(dataset, num_hosts, seed):.1%} of the records "
             f"each epoch, more than {MAX_LEFT_OUT:.0%})")
  return (f"every host reads all {files or 'the'} train file(s) and keeps "
          f"its slice of each global batch{why}")


def to_per_replica(batches, size, per_replica):
  """Batches of `size` cut to `per_replica`: a rebatch to the same size
  is not free (it copies each batch: 2-3% of the input's images/s)."""
  return batches if per_replica == size else batches.rebatch(per_replica)


def host_slice(batches, context, per_host, finish_batch, *, sliced=False):
  """Cuts a stream of per-host batches into this host's per-replica
  batches.

  Global batch k is the same examples whatever the number of hosts and
  replicas: host i takes per-host batch k * num_hosts + i (`sliced`: the
  stream holds only those already).
  """
  hosts = context.num_input_pipelines
  if hosts > 1 and not sliced:
    batches = batches.shard(hosts, context.input_pipeline_id)
  batches = to_per_replica(batches, per_host,
                           context.get_per_replica_batch_size(
                               per_host * hosts))
  if finish_batch is not None:
    # Per-batch, not per-example, maps: a per-example map costs ~20x here.
    batches = batches.map(finish_batch, num_parallel_calls=tf.data.AUTOTUNE,
                          deterministic=True)
  return batches.prefetch(tf.data.AUTOTUNE)
