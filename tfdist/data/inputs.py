"""Inputs: what the Trainer and the eval pass are handed, made from a
Dataset (tfdist.data.pipeline's train input function), from the tf.data
service, or from a task's own input functions.

Train batches are the examples batched; eval batches are (features,
labels, mask) or (features, labels, mask, sample_weight), where the mask
is 0 on padding examples so that eval counts each real example exactly
once.
"""

import dataclasses
from typing import Callable, Optional, Tuple

from absl import logging
import tensorflow as tf

from tfdist.data import cache as cache_lib
from tfdist.data import eval_input
from tfdist.data import plan as plan_lib
from tfdist.data import sharding as sharding_lib
from tfdist.data import service as service_lib
from tfdist.data import sources
from tfdist.data.pipeline import SHUFFLE_BUFFER
from tfdist.data.pipeline import train_input_fn
from tfdist.errors import ConfigError


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
  # What decides the order of the train examples besides the seed: kept
  # with the checkpoint, so that a resume on another plan says so.
  plan: Optional[dict] = None
  # {name: variable}: the input's own position, kept in the checkpoint
  # (which restores without it when it has none) and the survivor state,
  # and taken from the chief as the step is.
  state: dict = dataclasses.field(default_factory=dict)
  # {path: [bytes, mtime, records]}: kept in the run record, so that a
  # resume does not count the files again.
  record_counts: Optional[dict] = None


def _unplanned_on_workers(dataset, sharding, policy, cache):
  """Parameter-server workers shard by file only a FileData streamed in
  its plan: `batch` (each reads all, in an order of its own), or a line
  for `file`."""
  if sharding != "file":
    return "batch"
  what = ("a pipeline built by hand" if sharding_lib.hand_built(dataset)
          else cache_lib.describe(policy.cache, dataset))
  raise ConfigError(
      "--input_sharding=file on parameter-server workers takes a "
      f"tfdist.FileData streamed from its files; {dataset.name} is {what}. "
      "Use --cache=off with a FileData, or --input_sharding=batch. "
      f"Received: input_sharding=file, cache={cache}")


def _eval_hosts(dataset, global_batch_size, cache, hosts, requested):
  """The hosts eval is read by file on (eval_input.by_file_steps), or 1
  (every host reads it all). Parameter servers evaluate on the
  coordinator alone. A capped eval (--eval_steps below the batches by
  file) reads by batch: the same examples on any number of hosts."""
  by_file = eval_input.by_file_steps(dataset, global_batch_size, hosts, cache)
  if not by_file or (requested and requested < by_file):
    return 1
  logging.info("Eval input: each of the %d hosts reads only its own eval "
               "files, padded to the batches of the host with the most "
               "records.", hosts)
  return hosts


def inputs_from_dataset(dataset: sources.Dataset, *, global_batch_size,
                        seed, eval_steps_requested=0, sharding="batch",
                        num_hosts=1, cache="auto",
                        shuffle_buffer=SHUFFLE_BUFFER,
                        asynchronous=False) -> Inputs:
  """tfdist's own pipeline over unbatched examples; `seed`: the run's.
  `asynchronous`: the `num_hosts` are parameter-server workers, which
  read all the data each in an order of its own, or (file sharding) each
  its own files in the run's plan."""
  policy = cache_lib.Policy.of(dataset, cache)
  if asynchronous and not policy.planned and num_hosts > 1:
    sharding = _unplanned_on_workers(dataset, sharding, policy, cache)
  mode = sharding_lib.resolve_sharding(dataset, sharding, num_hosts,
                                       seed=seed, streamed=policy.planned)
  if not dataset.in_memory:
    logging.info("Input: %s is %s.", dataset.name,
                 cache_lib.describe(policy.cache, dataset))
  if num_hosts > 1:
    logging.info("Input sharding: %s: %s.", mode, (
        f"each of the {num_hosts} parameter-server workers reads all the "
        "train data, in an order of its own" if asynchronous and
        mode == "batch" else sharding_lib.describe(
            dataset, mode, sharding, num_hosts, policy.planned, seed)))
  # File sharding on asynchronous workers keeps the run's plan (its seed).
  workers = num_hosts if asynchronous and mode == "file" else None
  eval_hosts = _eval_hosts(dataset, global_batch_size, cache,
                           1 if asynchronous else num_hosts,
                           eval_steps_requested)
  return Inputs(
      plan={**plan_lib.input_plan(dataset, global_batch_size, seed,
                                  shuffle_buffer),
            "sharding": mode,
            "input_pipelines": num_hosts if mode == "file" else 1},
      name=dataset.name,
      train_fn=lambda start_step, own_seed: train_input_fn(
          dataset, global_batch_size=global_batch_size,
          seed=seed if workers else own_seed, start_step=start_step,
          sharding=mode, cache=cache, shuffle_buffer=shuffle_buffer,
          workers=workers, resolved_for=num_hosts),
      eval_fn=lambda: eval_input.eval_input_fn(
          dataset, global_batch_size=global_batch_size, cache=cache,
          num_hosts=eval_hosts),
      eval_steps=eval_input.eval_steps(
          dataset, global_batch_size=global_batch_size,
          requested=eval_steps_requested, num_hosts=eval_hosts,
          cache=cache),
      sample=sources.sample_batch(dataset),
      features_spec=sources.features_spec(dataset),
      image_input=dataset.input_shape is not None,
      record_counts=dataset.record_counts)


def served_inputs(dataset: sources.Dataset, *, service, reader, run_name,
                  global_batch_size, seed, lag, eval_steps_requested=0,
                  cache="auto", shuffle_buffer=SHUFFLE_BUFFER) -> Inputs:
  """tfdist's own pipeline with its train part on the tf.data service
  (tfdist.data.service); eval stays here. `lag`: an int64 variable, the
  examples the served stream runs behind the step count."""
  train_fn = service_lib.served_train_fn(
      dataset, service=service, reader=reader, run_name=run_name,
      global_batch_size=global_batch_size, seed=seed,
      shuffle_buffer=shuffle_buffer, unservable_ops=sources.unservable_ops,
      lag=lag)
  local = inputs_from_dataset(
      dataset, global_batch_size=global_batch_size, seed=seed,
      eval_steps_requested=eval_steps_requested, cache=cache,
      shuffle_buffer=shuffle_buffer)
  return dataclasses.replace(
      local, train_fn=lambda start_step, _seed: train_fn(start_step),
      state={"served_stream_lag": lag},
      plan={**plan_lib.input_plan(dataset, global_batch_size, seed,
                            shuffle_buffer),
            "sharding": f"tf.data service ({service.mode})"})


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
