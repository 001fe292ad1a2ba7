"""Builds a Trainer's parts from a Config, a strategy and a Task.

The input, the model (tfdist.model_setup) and the optimizer, the compiled
loops and their runner, the run's state (tfdist.state_setup: checkpoints,
survivors, the chief's broadcast), the summaries, the best keeper and the
export: made here, then handed to tfdist.trainer.Trainer.
"""

import contextlib
import dataclasses
import functools

from absl import logging
import tensorflow as tf

from tfdist import best as best_lib
from tfdist import callbacks as callbacks_lib
from tfdist import compiled_loops
from tfdist import compression
from tfdist import config as config_lib
from tfdist import data
from tfdist.data import agreement as data_agreement
from tfdist.data import service as data_service
from tfdist import devices
from tfdist import ema
from tfdist import evaluation
from tfdist import metric_direction
from tfdist import model_setup
from tfdist import export
from tfdist import optimizers
from tfdist import preflight
from tfdist import released
from tfdist import replica_check
from tfdist import runners
from tfdist import sharded_optimizer
from tfdist import sharded_params
from tfdist import state_setup
from tfdist import storage
from tfdist import summaries as summaries_lib
from tfdist import task as task_lib
from tfdist import trainer as trainer_lib
from tfdist import warm_start as warm_start_lib
from tfdist.errors import ConfigError


def resolve_task(config, info, task=None):
  """The Task to train: the one given (Python API), else the Config's."""
  if task is not None:
    return task
  local = devices.local_devices()
  return task_lib.from_config(
      config, partitioner=info.partitioner,
      tensor_parallel_devices=(local[:config.tensor_parallel]
                               if config.model_parallel == "tensor" else None))


def _learning_rate_at(optimizer, schedule, step):
  """The rate TensorBoard shows: the optimizer's own when it is a
  variable (a callback such as ReduceLROnPlateau may have set it), else
  the schedule's at `step`."""
  rate = callbacks_lib.rate_variable(optimizer)
  if rate is not None:
    return float(rate.numpy())
  return optimizers.scheduled_rate(step, **schedule)


def resolve_callbacks(config, given=None):
  """The Keras callbacks of a run: `given` (the Python API) and those
  --callbacks=module:function returns."""
  found = list(given or ())
  if config.callbacks:
    function = task_lib.import_object(config.callbacks, flag="callbacks")
    made = task_lib.call_user(function, flag="callbacks",
                              reference=config.callbacks)
    if not isinstance(made, (list, tuple)):
      raise ConfigError(f"--callbacks={config.callbacks} returned a "
                        f"{type(made).__name__}, not a list of "
                        "keras.callbacks.Callback objects.")
    found.extend(made)
  return callbacks_lib.check(found)


@dataclasses.dataclass(frozen=True)
class _Parts:
  """The model and what updates it: made under the strategy's scope."""

  model: object
  optimizer: object
  schedule: dict
  global_step: object
  reducer: object
  # With --shard: a sharded_optimizer.ShardedUpdate (optimizer,
  # gradients) or a sharded_params.ShardedParams (params); else None.
  sharded: object
  example: tuple  # (labels, outputs) of the model run on the sample.


def _inputs(config, info, task):
  if task.controls_input:
    if config.data_service:
      raise ConfigError(f"{task.display_name} makes its own input "
                        "(train_input): --data_service serves tfdist's own "
                        "pipeline only.")
    return data.inputs_from_task(task, global_batch_size=config.batch_size,
                                 eval_steps_requested=config.eval_steps)
  if config.data_service:
    with info.strategy.scope():  # Taken from the chief as the step is.
      lag = tf.Variable(0, dtype=tf.int64, trainable=False,
                        name="served_stream_lag")
    return data.served_inputs(
        task.data(), service=data_service.Service(
            address=config.data_service, mode=config.data_service_mode),
        reader=data_service.reader_for(info), run_name=config.model_dir,
        global_batch_size=config.batch_size, seed=config.seed, lag=lag,
        eval_steps_requested=config.eval_steps, cache=config.cache,
        shuffle_buffer=config.shuffle_buffer)
  return data.inputs_from_dataset(
      task.data(), global_batch_size=config.batch_size,
      eval_steps_requested=config.eval_steps,
      seed=config.seed, sharding=config.input_sharding,
      num_hosts=info.num_workers, cache=config.cache,
      shuffle_buffer=config.shuffle_buffer,
      asynchronous=info.coordinator is not None)


def _model_and_optimizer(config, info, task, sample):
  """The model, the optimizer and, with --shard, the sharded update that
  holds the optimizer's state (and with --shard=params, the weights)
  instead."""
  strategy = info.strategy
  stage = preflight.sharding(config, info)
  with strategy.scope():
    model = model_setup.build_model(config, task, sample,
                                     deferred=stage == "params")
    if config.sync_batchnorm:
      model_setup.synchronize_batchnorm(model)
    schedule = optimizers.schedule_kwargs(config)
    optimizer = optimizers.create(
        config.optimizer, schedule=schedule, weight_decay=config.weight_decay,
        mixed_precision=config.mixed_precision, ema_decay=config.ema_decay)
    if stage == "none":
      # Sharded, it stays unbuilt: the replicas' shard optimizers hold the
      # state, and it keeps the run's rate and step count.
      optimizer.build(model.trainable_variables)
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                              name="global_step")
    reducer = compression.create(config, model.trainable_variables)
  # Before sharding releases the weights.
  with released.forgotten_on_failure():
    example = model_setup.check_model_fits_data(task, model, sample)
    sharded = _sharded(config, stage, strategy, model, optimizer, schedule)
  if stage == "params":
    with strategy.scope():
      released.initialize_held()
    model_setup.check_sharded_forward(strategy, model, sharded, sample[0])
  if config.allreduce_compression != "none" and info.num_replicas > 1:
    logging.info("%s.", reducer.describe())
  return _Parts(model=model, optimizer=optimizer, schedule=schedule,
                global_step=global_step, reducer=reducer, sharded=sharded,
                example=example)


def _sharded(config, stage, strategy, model, optimizer, schedule):
  """The sharded update of --shard (or None)."""
  if stage == "none":
    return None
  make_optimizer = functools.partial(
      optimizers.create, config.optimizer, schedule=schedule,
      weight_decay=config.weight_decay)
  if stage == "params":
    sharded = sharded_params.ShardedParams(
        strategy=strategy, model=model, optimizer=optimizer,
        clip_norm=config.clip_norm, make_optimizer=make_optimizer,
        reshard=config.reshard_after_forward)
    logging.info("--shard=params: %d unit(s) of %s, each gathered as it "
                 "runs.", len(sharded.units), model.name)
    return sharded
  return sharded_optimizer.ShardedUpdate(
      strategy=strategy, variables=model.trainable_variables,
      optimizer=optimizer, clip_norm=config.clip_norm,
      make_optimizer=make_optimizer)


def _loops(config, info, task, parts, sample, local):
  class_weight = config_lib.class_weights(config.class_weight)
  if class_weight:
    model_setup.check_integer_labels(sample[1])
  return compiled_loops.LoopFunctions(
      strategy=info.strategy, model=parts.model, optimizer=parts.optimizer,
      task=task, metrics=compiled_loops.Metrics(task.metrics(),
                                                example=parts.example),
      global_batch_size=config.batch_size,
      steps_per_loop=config.steps_per_loop, global_step=parts.global_step,
      grad_accum_steps=config.grad_accum_steps, clip_norm=config.clip_norm,
      reducer=parts.reducer, class_weight=class_weight,
      sharded=parts.sharded,
      jit_compile=preflight.jit_mode(config, info, local),
      measure_input_wait=_measures_input_wait(info, local))


def _measures_input_wait(info, local):
  """The input wait is measured on CPUs only: the stamps keep a batch's
  fetch from overlapping the step before it, which is free for a batch
  already prefetched in host memory, but would stop an accelerator's copy
  of it from overlapping that step. Not on parameter servers either (a
  read from a parameter server each step)."""
  if info.coordinator is not None or isinstance(info.strategy,
                                                tf.distribute.TPUStrategy):
    return False
  return all(tf.DeviceSpec.from_string(device).device_type == "CPU"
             for device in local)


def _startup_scalars(info, parts):
  scalars = {}
  if info.name in ("multi_worker_mirrored", "parameter_server"):
    # An elastic job's size over time (tools.chaos --elastic, launch.local
    # --workers=MIN:MAX): one point per (re)start.
    scalars["workers"] = info.num_workers
  sharded = parts.sharded
  scalars.update(model_setup.memory_per_device(
      parts.model, parts.optimizer, info.strategy,
      shard_optimizers=sharded.optimizers if sharded else (),
      weights=[*released.held_weights(parts.model),
               *(s for shards in getattr(sharded, "weight_shards", ())
                 for s in shards)]))
  return scalars


def _export_fn(config, task, parts, inputs, write_dir, *, trains):
  if trains:  # Not an eval process: it may run beside the one exporting.
    for name in ("export", best_lib.BEST_EXPORT_DIR):
      # An export a kill cut short is whole again before anything reads it.
      storage.finish_replace(storage.join(write_dir, name))

  def export_now(best=False):
    if not config.export:
      return None
    # Every worker exports (saving may need collectives); only the chief's
    # write_dir is model_dir.
    export_dir = storage.join(
        write_dir, best_lib.BEST_EXPORT_DIR if best else "export")
    whole = getattr(parts.sharded, "whole_weights", contextlib.nullcontext)
    with ema.averaged_weights(parts.optimizer), whole():
      export.export_saved_model(
          parts.model, serving_outputs=task.serving_outputs,
          features_spec=inputs.features_spec, export_dir=export_dir,
          input_name="images" if inputs.image_input else "features")
    logging.info("Exported SavedModel to %s.", export_dir)
    return export_dir
  return export_now


def _best_and_callbacks(config, info, parts, store, metric_names, callbacks):
  """The best tracker (or None) and the Keras callbacks (or None).

  A training run that does not evaluate as it goes (--mode=train or
  --eval_every=0) leaves the best and early stopping to the sidecar
  evaluator (or a --mode=continuous_eval process): two trackers would
  both write best_checkpoint. It stops when best.json says so."""
  evaluates_elsewhere = info.reason != "sidecar evaluator" and (
      config.mode == "train" or (config.mode == "train_and_eval"
                                 and not config.eval_every))
  tracker = None
  if config.best_metric:  # Checks the metric's name in every task.
    tracker = best_lib.BestTracker(
        metric=config.best_metric,
        mode=metric_direction.resolve_mode(config.best_metric,
                                           config.best_mode),
        patience=config.early_stopping_patience,
        metric_names=("loss", *metric_names))
  if evaluates_elsewhere and tracker:
    tracker = None
    logging.info("--best_metric: this run makes no evals as it goes "
                 "(--eval_every=0 or --mode=train); a sidecar evaluator or "
                 "a --mode=continuous_eval process keeps the best%s.",
                 " and stops the run early"
                 if config.early_stopping_patience else "")
  if config.early_stopping_patience and evaluates_elsewhere:
    callbacks = [*callbacks, best_lib.SidecarStop(
        read_state=store.read_best_state, metric=config.best_metric,
        checkpoint_every=config.checkpoint_every,
        global_step=parts.global_step)]
  if not callbacks:
    return tracker, None
  return tracker, callbacks_lib.Callbacks(
      callbacks, model=parts.model, optimizer=parts.optimizer,
      is_chief=info.is_chief, train_steps=config.train_steps,
      eval_every=(config.eval_every if config.mode == "train_and_eval"
                  else 0),
      sync=callbacks_lib.chief_values(info.strategy) if info.peers else None)


@dataclasses.dataclass(frozen=True)
class _RunParts:
  """What a training run and a sidecar evaluator are both made of."""

  inputs: object
  parts: object
  loops: object
  store: object
  runner: object
  summaries: object
  eval_pass: object
  keeper: object  # An evaluation.BestKeeper, or None.
  callbacks: object  # A callbacks_lib.Callbacks, or None.
  export_fn: object
  survivor: object  # A survivor_lib.SurvivorState, or None.


def _run_parts(config, info, task, *, write_dir, callbacks):
  if preflight.sharding(config, info) == "params":
    callbacks_lib.check_sharded_weights(callbacks)
  local = devices.local_devices()
  preflight.check_run(config, info, local)
  inputs = _inputs(config, info, task)
  if info.peers and not info.coordinator and inputs.record_counts:
    # A peer that failed before it (its files did not parse, say) is a
    # lost peer here: one line, not the collective's traceback.
    with runners.peer_losses_named(info.task_name, info.peers):
      data_agreement.check_same_files(info.strategy, inputs.record_counts,
                                      info.task_name)
  parts = _model_and_optimizer(config, info, task, inputs.sample)
  loops = _loops(config, info, task, parts, inputs.sample, local)
  store = state_setup.checkpoint_store(config, task, parts, write_dir, inputs)
  if info.coordinator:
    model_setup.log_ps_placement(parts.model)
  tracker, keras_callbacks = _best_and_callbacks(
      config, info, parts, store, loops.metrics.names, callbacks)
  survivor = state_setup.survivor_state(config, info, parts, store, inputs)
  # With callbacks, which may change the optimizer's variables (its
  # learning rate) after a call, the Trainer commits after them instead.
  runner = runners.create(
      info, loops, train_feed=config.train_feed,
      survivor=None if keras_callbacks else survivor,
      scratch_dir=None if write_dir == config.model_dir else write_dir)
  summaries = summaries_lib.Summaries(
      config.model_dir, enabled=info.is_chief,
      metrics_file=config.metrics_file or None)
  export_fn = _export_fn(
      config, task, parts, inputs, write_dir,
      trains=(info.reason != "sidecar evaluator"
              and config.mode in ("train", "train_and_eval")))
  return _RunParts(
      inputs=inputs, parts=parts, loops=loops, store=store, runner=runner,
      summaries=summaries,
      eval_pass=evaluation.EvalPass(
          runner=runner, inputs=inputs, metrics=loops.metrics,
          summaries=summaries,
          eval_weights=functools.partial(ema.averaged_weights,
                                         parts.optimizer)),
      keeper=(evaluation.BestKeeper(
          tracker=tracker, checkpoints=store,
          export_fn=export_fn if config.export else None)
              if tracker else None),
      callbacks=keras_callbacks, export_fn=export_fn, survivor=survivor)


def build_evaluator(config, info, task, *, write_dir):
  """A sidecar evaluator (--mode=eval, continuous_eval, the evaluator
  task) over the parts of a run."""
  run = _run_parts(config, info, task, write_dir=write_dir, callbacks=())
  return evaluation.SidecarEvaluator(
      train_steps=config.train_steps, global_step=run.parts.global_step,
      checkpoints=run.store, eval_pass=run.eval_pass,
      summaries=run.summaries, keeper=run.keeper)


def build_trainer(config, info, task, *, write_dir, callbacks=()):
  """Every part of a run, handed to a Trainer."""
  run = _run_parts(config, info, task, write_dir=write_dir,
                   callbacks=callbacks)
  parts, model, optimizer = run.parts, run.parts.model, run.parts.optimizer
  return trainer_lib.Trainer(
      options=trainer_lib.LoopOptions.from_config(config), model=model,
      optimizer=optimizer, global_step=parts.global_step,
      runner=run.runner, loops=run.loops, checkpoints=run.store,
      summaries=run.summaries, inputs=run.inputs, eval_pass=run.eval_pass,
      describe=(f"{task.display_name} on {run.inputs.name} with {info.name} "
                f"over {info.num_replicas} replica(s)"),
      learning_rate=functools.partial(_learning_rate_at, optimizer,
                                      parts.schedule),
      replica_checker=(replica_check.ReplicaChecker(
          strategy=info.strategy,
          variables=released.held_weights(model),
          replicas_per_worker=max(info.num_replicas // info.num_workers, 1))
                       if config.check_replicas_every else None),
      export_fn=run.export_fn,
      after_restore=state_setup.after_restore_fn(config, parts, run.store),
      hparams=config.to_dict(),
      startup_scalars=_startup_scalars(info, parts),
      chief_broadcast=state_setup.chief_broadcast(
          info, parts, run.keeper.tracker if run.keeper else None,
          run.inputs, run.store),
      callbacks=run.callbacks, best=run.keeper, survivor=run.survivor,
      warm_start=(functools.partial(
          warm_start_lib.load, model, config.init_checkpoint,
          skip=config.init_checkpoint_skip)
                  if config.init_checkpoint else None))
