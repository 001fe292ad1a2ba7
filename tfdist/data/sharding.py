"""Which host reads what: `batch` (every host reads the whole stream and
keeps its slice of each global batch) or `file` (each host reads only its
own files)."""

import tensorflow as tf

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
  MAX_LEFT_OUT of the records; `batch` otherwise, which keeps global
  batch k the same on any number of hosts (cached data costs nothing to
  read again).
  """
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
             or dataset.in_memory else " (a dataset built by hand: tfdist "
             "does not know its files)")
    elif files < num_hosts:
      why = (f" ({files} train file(s) for {num_hosts} hosts: too few for "
             "one each)")
    else:
      why = (f" (by file, {files} files on {num_hosts} hosts would leave "
             f"out {_left_out(dataset, num_hosts, seed):.1%} of the records "
             f"each epoch, more than {MAX_LEFT_OUT:.0%})")
  return (f"every host reads all {files or 'the'} train file(s) and keeps "
          f"its slice of each global batch{why}")


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
  if context.num_replicas_in_sync > hosts:
    batches = batches.rebatch(context.get_per_replica_batch_size(
        per_host * hosts))
  if finish_batch is not None:
    # Per-batch, not per-example, maps: a per-example map costs ~20x here.
    batches = batches.map(finish_batch, num_parallel_calls=tf.data.AUTOTUNE,
                          deterministic=True)
  return batches.prefetch(tf.data.AUTOTUNE)
