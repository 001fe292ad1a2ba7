"""The model a run trains: built under the strategy (placed per the
model-parallel plan) from the run's seed, checked against the data in one
line, and what its variables and optimizer state weigh on each device.
"""

import re

from absl import logging
import keras
import tensorflow as tf

from tfdist import compiled_loops
from tfdist import devices
from tfdist import errors
from tfdist import placement
from tfdist import released
from tfdist import runners
from tfdist.errors import ConfigError


def _lost_peer(error):
  """A collective that lost a peer (a variable's first value comes from
  worker 0 by one), not the user's model or loss failing on the data:
  it goes up as it is, to end as a lost peer."""
  return runners.is_collective_failure(error)


def _features(batch):
  return batch[0]


def _build_variables(model, example):
  if isinstance(model, keras.Sequential) and not model.built:
    placement.build_blocks(model.layers, example)
  elif not model.built:
    model(example)


def _pipeline(config, task, model, example):
  if not isinstance(model, keras.Sequential):
    raise ConfigError(f"model {task.display_name!r} is not a chain of "
                      "blocks (a keras.Sequential) and cannot be split into "
                      "pipeline stages; use mlp or transformer, or build a "
                      "keras.Sequential of named blocks.")
  local = devices.local_devices()
  # Build once where TF likes, only to weigh the blocks for the plan...
  placement.build_blocks(model.layers, example)
  sizes = [(b.name, placement.params(b)) for b in model.layers]
  if config.placement:
    plan = placement.plan_from_spec(placement.parse_spec(config.placement),
                                    [name for name, _ in sizes])
    placement.check_devices([s.device for s in plan.stages], local)
  else:
    plan = placement.auto_plan(sizes, local, config.num_stages)
  # ...then again, from the same seed, with each block on its device.
  keras.utils.set_random_seed(config.seed)
  blocks = list(task.build_model().layers)
  placement.build_blocks(blocks, example, plan)
  pipelined = placement.PipelinedModel(
      blocks, plan, config.num_microbatches,
      name=f"{task.display_name.replace(':', '_')}_pipeline")
  for line in placement.table(plan, {b.name: b for b in blocks}):
    logging.info("placement %s", line)
  return pipelined


def build_model(config, task, sample, *, deferred=False):
  """The task's model with its variables created, under the strategy;
  `deferred` (--shard=params): without values where Keras can
  (tfdist.released.build_deferred), else whole, with a log line."""
  if not deferred:
    return _build_model(config, task, sample)
  model, why = released.build_deferred(
      lambda: _build_model(config, task, sample))
  if model is not None:
    return model
  logging.info("--shard=params: %s %s, so its whole weights are made once "
               "before they are sharded.", task.display_name, why)
  return _build_model(config, task, sample)


def _build_model(config, task, sample):
  """The task's model with its variables created, under the strategy.

  Seeded here, just before the model is built: whatever ran before (a
  dataset prepared on first use, a user's data function) may have drawn
  from the global generators, and the same seed must give the same
  weights whatever was on disk.
  """
  keras.utils.set_random_seed(config.seed)
  model = task.build_model()
  if not isinstance(model, keras.Model):
    raise ConfigError(f"{task.display_name}.build_model() returned a "
                      f"{type(model).__name__}, not a keras.Model.")
  example = _features(sample)
  if config.model_parallel == "pipeline":
    return _pipeline(config, task, model, example)
  try:
    _build_variables(model, example)
  except ConfigError:
    raise
  except Exception as e:  # Keras raises many types for mismatched inputs.
    if _lost_peer(e):
      raise
    raise ConfigError(f"the dataset's features do not fit the model "
                      f"{task.display_name!r}: {errors.first_line(e, 240)}") from None
  _warn_summed_variables(model, tf.distribute.get_strategy())
  return model


def _warn_summed_variables(model, strategy):
  """Keras 3 updates a variable as assign(v + delta): with
  aggregation="sum" the replicas' assigns are summed, so the variable is
  multiplied by the replica count at each update."""
  replicas = strategy.num_replicas_in_sync
  # An on-read variable (a metric's) keeps a copy per replica: correct.
  summed = [v.path for v in model.variables
            if getattr(v, "aggregation", None) == "sum"
            and getattr(v, "synchronization", None) != "on_read"]
  if replicas > 1 and summed:
    logging.warning(
        "%s: aggregation=\"sum\" under %d replicas multiplies the value by "
        "%d at each update (Keras assigns v + delta on every replica, and "
        "the assigns are summed). For a count, use "
        "aggregation=\"only_first_replica\" and add the global amount, or a "
        "keras.metrics.Sum.", ", ".join(summed), replicas, replicas)


def synchronize_batchnorm(model):
  """Makes every BatchNormalization layer all-reduce its batch statistics
  (Keras reads `synchronized` at each call)."""
  layers = [layer for layer in model._flatten_layers()  # pylint: disable=protected-access
            if isinstance(layer, keras.layers.BatchNormalization)]
  for layer in layers:
    layer.synchronized = True
  if layers:
    logging.info("--sync_batchnorm: %d BatchNormalization layer(s) use the "
                 "global batch's statistics.", len(layers))
  else:
    logging.warning("--sync_batchnorm: the model has no BatchNormalization "
                    "layer; nothing to synchronize.")


def check_model_fits_data(task, model, sample):
  """Runs the model and the loss on a few examples, for one-line errors;
  returns (labels, outputs)."""
  features, labels = sample
  try:
    model(features, training=False)
  except Exception as e:  # Keras raises many types for mismatched inputs.
    if _lost_peer(e):
      raise
    raise ConfigError(f"the dataset's features do not fit the model "
                      f"{task.display_name!r}: {errors.first_line(e, 240)}") from None
  try:
    _, outputs = compiled_loops.loss_and_outputs(task, model, features,
                                                 labels, training=False)
  except ConfigError:
    raise
  except Exception as e:  # The loss may raise anything on bad labels.
    if _lost_peer(e):
      raise
    raise ConfigError(f"the labels do not fit the loss of "
                      f"{task.display_name!r}: {errors.first_line(e, 240)}") from None
  return labels, outputs


def check_sharded_forward(strategy, model, sharded, features):
  """--shard=params: traces (does not run) the model's training forward
  on gathered weights, so that what the units refuse (a weight read
  outside its layer's call, a stateful random op) is one line before the
  first step, not a traceback in it. Keras and autograph wrap the error:
  its own line is found in the message."""
  @tf.function
  def forward():
    def replica_fn():
      with sharded.gathering():
        return model(features, training=True)
    return strategy.run(replica_fn)

  try:
    forward.get_concrete_function()
  except Exception as e:  # Keras re-raises what a layer raised, wrapped.
    if _lost_peer(e):
      raise
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
             for line in str(e).splitlines()]
    own = [line for line in lines if "sharded weights:" in line]
    raise ConfigError(
        own[0][own[0].index("sharded weights:"):] if own else
        f"--shard=params: the model does not run on gathered weights: "
        f"{errors.first_line(e, 240)}") from None


def check_integer_labels(labels):
  """--class_weight needs one integer class per example."""
  if not (isinstance(labels, tf.Tensor) and labels.dtype.is_integer and (
      labels.shape.rank == 1 or (labels.shape.rank == 2
                                 and labels.shape[-1] == 1))):
    raise ConfigError(
        "--class_weight needs one integer class label per example. "
        f"Received: labels {getattr(labels, 'dtype', type(labels).__name__)}"
        f" of shape {getattr(labels, 'shape', '?')} per batch")


def log_ps_placement(model):
  """Bytes of model variables per parameter server."""
  def task_of(weight):
    spec = tf.DeviceSpec.from_string(weight.value.device)
    return f"{spec.job}:{spec.task}"
  names = {}
  for weight in model.weights:
    names.setdefault(task_of(weight), []).append(weight.path)
  for task, size in devices.bytes_by(model.weights, task_of).items():
    logging.info("placement %s: %d bytes in %d variable(s): %s", task, size,
                 len(names[task]), ", ".join(names[task]))


def memory_per_device(model, optimizer, strategy, shard_optimizers=(),
                      weights=None):
  """Logs the bytes of the variables and of the optimizer state on each
  device (a mirrored copy counts on each replica's device); returns them
  as startup scalars variable_bytes/<device>, optimizer_bytes/<device>.
  `weights`: the variables held (default: the model's)."""
  weights = devices.bytes_per_device(
      model.weights if weights is None else weights, strategy)
  state = devices.bytes_per_device(
      [*optimizer.variables,
       *(v for o in shard_optimizers for v in o.variables)], strategy)
  trainable = sum(devices.variable_bytes(w) for w in model.trainable_weights)
  held = {d: (weights.get(d, 0), state.get(d, 0))
          for d in sorted(set(weights) | set(state))}

  def sizes(pair):
    return (f"variables {pair[0] / 1e6:.2f} MB, optimizer state "
            f"{pair[1] / 1e6:.2f} MB")

  if len(set(held.values())) == 1:
    pair = next(iter(held.values()))
    where = (f"each of {len(held)} devices ({', '.join(held)})"
             if len(held) > 1 else next(iter(held)))
    logging.info("Memory on %s: %s (optimizer state %.1fx the trainable "
                 "weights).", where, sizes(pair),
                 pair[1] / max(trainable, 1))
  else:
    logging.info("Memory: %s.", "; ".join(
        f"{d}: {sizes(pair)}" for d, pair in held.items()))
  scalars = {}
  for device, (variable_size, state_size) in held.items():
    scalars[f"variable_bytes/{device}"] = variable_size
    scalars[f"optimizer_bytes/{device}"] = state_size
  return scalars
