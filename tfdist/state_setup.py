"""A run's state: where it is kept (the checkpoint store and its run
record), what follows a restore, what each survivor keeps of a lost peer,
and the chief's state sent to every worker.
"""

import contextlib
import functools

from absl import logging

from tfdist import checkpoints
from tfdist import data
from tfdist import optimizers
from tfdist import replica_check
from tfdist import released
from tfdist import sharded_params
from tfdist import survivor as survivor_lib


def _log_schedule_change(previous, schedule, step):
  """A resume with another --train_steps moves a decay that runs to the
  end (decay_steps 0): say what the rate was going to be and what it is."""
  if previous is None or previous == schedule:
    return
  changed = ", ".join(f"{k} {previous.get(k)} -> {v}"
                      for k, v in schedule.items() if previous.get(k) != v)
  logging.warning(
      "The learning-rate schedule changed on resume at step %d: %s. The "
      "rate there is %.6g (the saved run's schedule gave %.6g).", step,
      changed, optimizers.scheduled_rate(step, **schedule),
      optimizers.scheduled_rate(step, **previous))


def checkpoint_store(config, task, parts, write_dir, inputs):
  sharded = parts.sharded
  return checkpoints.CheckpointStore(
      objects=dict(
          model=parts.model, step=parts.global_step,
          optimizer=sharded.checkpoint_view(
              parts.optimizer, parts.model.trainable_variables) if sharded
          else parts.optimizer),
      optional=inputs.state,
      saving=sharded.saving if sharded else contextlib.nullcontext,
      model_dir=config.model_dir, write_dir=write_dir,
      keep=config.keep_checkpoints,
      signature=checkpoints.model_signature(
          model_name=task.display_name, model=parts.model,
          num_classes=getattr(task, "num_classes", None)),
      run_record={"schedule": parts.schedule, "input": inputs.plan,
                  "record_counts": inputs.record_counts})


def after_restore_fn(config, parts, store):
  def after_restore():
    # PowerSGD's error buffers belong to the run that wrote the checkpoint.
    parts.reducer.reset()
    previous = store.previous_run or {}
    step = int(parts.global_step.numpy())
    _log_schedule_change(previous.get("schedule"), parts.schedule, step)
    plan_change = data.describe_plan_change(previous.get("input"),
                                            store.run_record.get("input"), step)
    if plan_change:
      logging.warning("%s", plan_change)
    # A constant rate is a variable in the checkpoint; the flag given now
    # wins. A schedule is a function of the restored step.
    if (parts.schedule["schedule"] == "constant"
        and not parts.schedule["warmup_steps"]):
      parts.optimizer.learning_rate.assign(config.learning_rate)
    if parts.sharded:
      parts.sharded.scatter_restored()
  return after_restore


def _run_state(parts, inputs):
  """Every variable of the run's state, as the checkpoint holds it (the
  model's weights, the optimizer's, the step and the input's own)."""
  return [*released.held_weights(parts.model),
          *parts.optimizer.variables,
          parts.global_step, *inputs.state.values()]


def survivor_state(config, info, parts, store, inputs):
  """MultiWorkerMirrored: the state each survivor keeps of a lost peer
  (tfdist.survivor), where one worker's copy is the whole state."""
  if not (config.survivor_state and info.peers) or info.coordinator:
    return None
  if parts.sharded:
    logging.info("--survivor_state: with --shard no worker holds the whole "
                 "state; a lost peer resumes from the last checkpoint.")
    return None
  return survivor_lib.SurvivorState(
      variables=_run_state(parts, inputs),
      step_variable=parts.global_step,
      write=functools.partial(store.write_survivor, info.task_name),
      task_name=info.task_name)


def chief_broadcast(info, parts, tracker, inputs, store):
  """Multi-worker: every worker takes the chief's state after the
  restore (no shared disk)."""
  if not info.peers:
    return None
  then = parts.sharded.share_restored if parts.sharded else None
  if isinstance(parts.sharded, sharded_params.ShardedParams):
    # It restored its own boxes: the chief reads its entries again.
    then = functools.partial(then, read_again=store.read_again)
  return replica_check.ChiefBroadcast(
      strategy=info.strategy, variables=[
          *_run_state(parts, inputs),
          *(tracker.variables if tracker else ())],
      then=then)
