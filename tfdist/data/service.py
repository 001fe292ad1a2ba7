"""Train input on the tf.data service: the pipeline, up to and including
batching, runs on data workers; the trainers read its batches.

One process registers the pipeline (the chief, or the PS coordinator)
under the run's job name; every trainer reads it with `from_dataset_id`.
The stream is cut into units, (epoch, slice of the epoch's examples),
that the dispatcher hands to data workers one at a time:

- `dynamic` (ShardingPolicy.DYNAMIC): each unit goes to one data worker,
  so an epoch is read once however many data workers there are; a data
  worker lost mid-unit loses the rest of that unit (at most once). Read
  in round-robin, with the units per epoch a multiple of the data workers
  and of equal size, the units of an epoch are used up together; read
  first come, first served (PS), the next epoch's units may start before
  the last of this one's is used up.
- `parallel_epochs` (ShardingPolicy.OFF): every data worker reads the
  whole stream, in an order of its own, as TF advises.

Synchronous trainers read in strict round-robin (`consumer_index`,
`num_consumers`, over an infinite stream), so every replica gets a batch
at every step and no trainer runs out before the others. Parameter-server
workers read first come, first served.

Job names carry the run (its model_dir, hashed), a token the trainers
agree on, the start step and the global batch: a resumed or restarted job
never reads an old job's batches.
"""

import dataclasses
import hashlib
import secrets

from absl import logging

from tfdist import errors
from tfdist.errors import ConfigError
from tfdist.service_address import MODES
from tfdist.service_address import parse_address

_TOKEN_LIMIT = 2**24  # Exact in a float32 all-reduce.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Service:
  """Where the service is and how a run reads it."""

  address: str  # grpc://HOST:PORT
  mode: str = "dynamic"

  def __post_init__(self):
    parse_address(self.address)
    if self.mode not in MODES:
      raise ConfigError(f"Unrecognized data_service_mode: {self.mode!r}. "
                        f"Valid: {', '.join(MODES)}.")

  @property
  def target(self):
    return (self.address if self.address.startswith("grpc://")
            else f"grpc://{self.address}")


def job_name(run_name, token, start_step, global_batch_size):
  """The run (its model_dir, hashed), the registering process's token,
  the start step and the global batch."""
  run = hashlib.sha1(run_name.encode()).hexdigest()[:6]
  return f"tfdist-{run}-{token:06x}-s{start_step}-b{global_batch_size}"


def new_token():
  # Not `random`: the run seeds it, and a restart must not draw the same.
  return 1 + secrets.randbelow(_TOKEN_LIMIT - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reader:
  """How this process takes part: `registers` (the chief, the PS
  coordinator or a lone trainer), `consumers` reading in round-robin (0:
  first come, first served), and `share(token)`, which gives every
  trainer the registering one's token once it has registered."""

  registers: bool
  consumers: int
  share: object  # Callable[[int], int]


def lone_reader(consumers=1):
  return Reader(registers=True, consumers=consumers, share=lambda t: t)


def served_train_fn(dataset, *, service: Service, reader: Reader, run_name,
                    global_batch_size, seed, shuffle_buffer, unservable_ops,
                    lag):
  """(start_step) -> input_fn reading the served train batches from the
  step `start_step` is at. `lag`: an int64 variable the checkpoint keeps,
  the examples the served stream runs behind the step count (a resume
  reads the epoch in progress again), so that a later resume finds the
  epoch the stream is in, not the one the step count is in."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.data import service_units  # pylint: disable=g-import-not-at-top
  from tfdist.data import sharding  # pylint: disable=g-import-not-at-top
  per_consumer = global_batch_size // max(reader.consumers, 1)

  def batches_from(first_unit, resume=0):
    return service_units.served_batches(
        dataset, mode=service.mode, seed=seed, first_unit=first_unit,
        batch_size=per_consumer, buffer=shuffle_buffer, resume=resume)
  _check_servable(dataset, batches_from(0), unservable_ops)
  if dataset.file_split is None:
    logging.info(
        "Input: %s on the tf.data service: %s.", dataset.name,
        "its source split among the data workers, each example made once"
        if service_units.by_source(dataset) else
        "cut in units, each reading the whole pipeline to keep its part "
        "(its source cannot be split: several sources, or a step such as "
        "take, skip or batch)")

  def train_fn(start_step):
    first_unit = 0  # parallel_epochs: each data worker's order of its own.
    if service.mode == "dynamic":
      first_unit, behind = service_units.resume_point(
          dataset, trained=start_step * global_batch_size,
          lag=int(lag.numpy()))
      lag.assign(behind)
    batches = batches_from(first_unit, start_step)
    name = _registered(batches, service, reader, (
        run_name, start_step, global_batch_size))
    spec = batches.element_spec
    policy = (tf.data.experimental.service.ShardingPolicy.DYNAMIC
              if service.mode == "dynamic"
              else tf.data.experimental.service.ShardingPolicy.OFF)

    def input_fn(context):
      coordinated = {}
      if reader.consumers:
        coordinated = {"consumer_index": context.input_pipeline_id,
                       "num_consumers": reader.consumers}
      served = tf.data.experimental.service.from_dataset_id(
          policy, service.target, name, element_spec=spec, job_name=name,
          **coordinated)
      served = sharding.to_per_replica(
          served, per_consumer,
          context.get_per_replica_batch_size(global_batch_size))
      return served.apply(tf.data.experimental.assert_cardinality(
          tf.data.INFINITE_CARDINALITY)).prefetch(tf.data.AUTOTUNE)
    return input_fn
  return train_fn


def _check_servable(dataset, batches, unservable_ops):
  """Refuses, before training starts, a pipeline the data workers could
  not run."""
  found = unservable_ops(batches)
  if found is None:
    raise ConfigError(
        f"{dataset.name}: its pipeline cannot be serialized for the "
        "tf.data service (does it read a Python generator?): build it "
        "from TensorFlow ops, or drop --data_service.")
  if found["python"]:
    raise ConfigError(
        f"{dataset.name}: its pipeline calls Python (tf.py_function or "
        "tf.numpy_function), which the tf.data service cannot ship to its "
        "data workers: build it from TensorFlow ops, or drop "
        "--data_service.")
  if found["foreign"]:
    raise ConfigError(
        f"{dataset.name}: its pipeline uses ops that are not TensorFlow's "
        f"own ({', '.join(sorted(found['foreign']))}), from a library the "
        "data workers have not loaded: build it from TensorFlow ops, or "
        "drop --data_service.")


def _registered(batches, service, reader, identity):
  """The job name every trainer agrees on, registered once. `identity`:
  (run name, start step, global batch). A registration that fails is
  shared as token -1, so that the other trainers fail at once too."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  token, failure = (new_token() if reader.registers else 0), None
  if reader.registers:
    try:
      tf.data.experimental.service.register_dataset(
          service.target, batches,
          dataset_id=job_name(identity[0], token, *identity[1:]))
    except (tf.errors.OpError, ValueError, TypeError) as e:
      failure = errors.first_line(e, 200)
      token = -1
  token = reader.share(token)
  if failure or token < 0:
    raise ConfigError(
        f"the train pipeline could not be registered with the tf.data "
        f"service at {service.address}: "
        + (failure or "the chief says why"))
  name = job_name(identity[0], token, *identity[1:])
  logging.info("Input: tf.data service %s (%s), job %s%s.", service.address,
               service.mode, name,
               f", {reader.consumers} trainers in round-robin"
               if reader.consumers > 1 else "")
  return name


def reader_for(info):
  """This process's part (a Reader) in a run with strategy `info` (a
  tfdist.strategies.StrategyInfo)."""
  if info.coordinator is not None:
    return Reader(registers=True, consumers=0, share=lambda t: t)
  if info.num_workers == 1:
    return lone_reader()
  return Reader(registers=info.is_chief, consumers=info.num_workers,
                share=lambda token: _all_reduced_token(info.strategy, token))


def _all_reduced_token(strategy, token):
  """The chief's token on every worker: an all-reduce after the chief has
  registered, so it also orders every read after the registration."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def replica_value(value):
    first = tf.distribute.get_replica_context().replica_id_in_sync_group == 0
    return tf.where(first, value, tf.constant(0.0))

  @tf.function
  def shared(value):
    return strategy.reduce(tf.distribute.ReduceOp.SUM,
                           strategy.run(replica_value, args=(value,)),
                           axis=None)
  return int(round(float(shared(tf.constant(float(token))))))
