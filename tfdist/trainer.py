"""The one outer loop: train, eval, checkpoint, summaries, export.

How steps run on each strategy lives in a step runner (tfdist.runners);
this loop is the same for all of them.
"""

import dataclasses
import datetime
import os
import time
from typing import Optional

from absl import logging
import keras
import numpy as np
import tensorflow as tf

import models
from tfdist import checkpoints
from tfdist import compression
from tfdist import data
from tfdist import export
from tfdist import optimizers
from tfdist import placement
from tfdist import replica_check
from tfdist import runners
from tfdist import steps
from tfdist import summaries
from tfdist.errors import ConfigError
from tfdist.errors import NonFiniteLossError


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What a finished run reports."""

  step: int
  eval_metrics: dict
  train_metrics: dict
  checkpoint: Optional[str]
  export_dir: Optional[str]
  seconds: float


def check_batch_size(global_batch_size, num_replicas):
  if global_batch_size % num_replicas:
    raise ConfigError(
        "batch_size (the global batch) must be divisible by the number of "
        f"replicas. Received: batch_size={global_batch_size} for "
        f"{num_replicas} replicas")


def check_jit_compile(jit_compile, strategy):
  if not jit_compile or strategy.num_replicas_in_sync == 1:
    return
  devices = strategy.extended.worker_devices
  if len(devices) > 1 and "GPU" not in devices[0].upper():
    raise ConfigError(
        "--jit_compile needs one device per process or GPUs: XLA places all "
        "logical CPU devices on CPU:0. Received: jit_compile=True with "
        f"{len(devices)} local CPU replicas")


def _next_multiple(step, every):
  return (step // every + 1) * every


class _Meter:
  """Running train metrics between two log lines."""

  def __init__(self, now, global_batch_size):
    self._global_batch_size = global_batch_size
    self.reset(now)

  def reset(self, now):
    self.start, self.steps, self.loss, self.correct = now, 0, 0.0, 0.0

  def add(self, sums, num_steps):
    self.steps += num_steps
    self.loss += float(np.sum(sums["step_loss"]))  # One entry per step.
    self.correct += float(sums["correct"])

  def read(self, now):
    seconds = max(now - self.start, 1e-9)
    global_batch_size = self._global_batch_size
    return {"loss": self.loss / max(self.steps, 1),
            "accuracy": self.correct / max(self.steps * global_batch_size, 1),
            "steps_per_sec": self.steps / seconds,
            "examples_per_sec": self.steps * global_batch_size / seconds}


class Trainer:
  """Trains `config.model` on `config.dataset` under one strategy."""

  def __init__(self, *, config, strategy_info, dataset, write_dir=None):
    check_batch_size(config.batch_size, strategy_info.num_replicas)
    check_jit_compile(config.jit_compile, strategy_info.strategy)
    if config.check_replicas_every and strategy_info.coordinator:
      raise ConfigError(
          "--check_replicas_every compares replicas' copies of the weights; "
          "under parameter_server there is one copy, on the ps tasks. "
          f"Received: check_replicas_every={config.check_replicas_every}")
    self._config = config
    self._info = strategy_info
    self._dataset = dataset
    self._strategy = strategy_info.strategy
    self._runner = runners.create(strategy_info)
    self._write_dir = write_dir or config.model_dir
    self._summaries = summaries.Summaries(config.model_dir,
                                          enabled=strategy_info.is_chief)
    self._eval_iterations = data.eval_steps(
        dataset, global_batch_size=config.batch_size,
        requested=config.eval_steps)
    self._last_checkpoint = None
    self._iterator, self._iterator_step = None, None
    self._build()

  # Construction --------------------------------------------------------

  def _build(self):
    config = self._config
    keras.mixed_precision.set_global_policy(
        "float32" if config.mixed_precision == "none"
        else config.mixed_precision)
    keras.utils.set_random_seed(config.seed)
    with self._strategy.scope():
      self.model = self._build_model()
      self.optimizer = optimizers.create(
          config.optimizer, learning_rate=config.learning_rate,
          mixed_precision=config.mixed_precision)
      compression.compress_gradients(self.optimizer, config.allreduce_dtype)
      self.optimizer.build(self.model.trainable_variables)
      self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name="global_step")
    self._loops = steps.LoopFunctions(
        strategy=self._strategy, model=self.model, optimizer=self.optimizer,
        global_batch_size=config.batch_size,
        steps_per_loop=config.steps_per_loop, global_step=self.global_step,
        jit_compile=config.jit_compile)
    self._checkpoints = checkpoints.CheckpointStore(
        checkpoint=tf.train.Checkpoint(model=self.model,
                                       optimizer=self.optimizer,
                                       step=self.global_step),
        model_dir=config.model_dir, write_dir=self._write_dir,
        keep=config.keep_checkpoints,
        signature=checkpoints.model_signature(
            model_name=config.model, model=self.model,
            num_classes=self._dataset.num_classes))
    self._replica_checker = (replica_check.ReplicaChecker(
        strategy=self._strategy, variables=self.model.weights,
        replicas_per_worker=max(
            self._info.num_replicas // self._info.num_workers, 1))
                             if config.check_replicas_every else None)
    if self._info.coordinator:
      self._log_placement()
    if config.model_parallel != "none":
      for device, size in placement.bytes_per_device(self.model).items():
        logging.info("variable bytes on %s: %d", device, size)
    self._runner.watch_preemption(
        save_fn=lambda: self._save(self.step), step_fn=lambda: self.step)

  def _build_model(self):
    """Builds the model's variables, on the devices the plan names."""
    config, shape = self._config, self._dataset.input_shape
    placement.check_strategy(config.model_parallel, self._info.name)
    devices = placement.local_devices()
    tensor_devices = None
    if config.model_parallel == "tensor":
      if config.tensor_parallel > len(devices):
        raise ConfigError(
            f"tensor_parallel={config.tensor_parallel} needs that many "
            f"devices; only {len(devices)} exist ({', '.join(devices)}). "
            "Raise --num_cpu_devices.")
      tensor_devices = devices[:config.tensor_parallel]
    model = models.build(config.model, input_shape=shape,
                         num_classes=self._dataset.num_classes,
                         partitioner=self._info.partitioner,
                         tensor_parallel_devices=tensor_devices)
    if config.model_parallel != "pipeline":
      if not model.built:
        placement.build_blocks(model.layers, shape)
      return model
    return self._pipeline(model, devices)

  def _pipeline(self, model, devices):
    config = self._config
    if not isinstance(model, keras.Sequential):
      raise ConfigError(f"model {config.model!r} is not a chain of blocks "
                        "and cannot be split into pipeline stages; use mlp "
                        "or transformer.")
    per_replica = config.batch_size // self._info.num_replicas
    if per_replica % config.num_microbatches:
      raise ConfigError(
          "num_microbatches must divide the per-replica batch. Received: "
          f"num_microbatches={config.num_microbatches} for a per-replica "
          f"batch of {per_replica}")
    # Build once where TF likes, only to weigh the blocks for the plan...
    placement.build_blocks(model.layers, self._dataset.input_shape)
    sizes = [(b.name, sum(int(np.prod(w.shape)) for w in b.weights))
             for b in model.layers]
    if config.placement:
      plan = placement.plan_from_spec(placement.parse_spec(config.placement),
                                      [name for name, _ in sizes])
      placement.check_devices([s.device for s in plan.stages], devices)
    else:
      plan = placement.auto_plan(sizes, devices, config.num_stages)
    # ...then again, from the same seed, with each block on its device.
    keras.utils.set_random_seed(config.seed)
    blocks = list(models.build(
        config.model, input_shape=self._dataset.input_shape,
        num_classes=self._dataset.num_classes).layers)
    placement.build_blocks(blocks, self._dataset.input_shape, plan)
    pipelined = placement.PipelinedModel(blocks, plan,
                                         config.num_microbatches,
                                         name=f"{config.model}_pipeline")
    for line in placement.table(plan, {b.name: b for b in blocks}):
      logging.info("placement %s", line)
    return pipelined

  # Public --------------------------------------------------------------

  def run(self) -> RunResult:
    """Resumes from model_dir if it can, then trains to train_steps."""
    config = self._config
    started = time.perf_counter()
    self.restore()
    self._summaries.hparams(config.to_dict())
    if config.model_parallel != "none":
      self._summaries.scalars("train", self.step, {
          f"variable_bytes/{device}": size for device, size in
          placement.bytes_per_device(self.model).items()})
    train_metrics = {}
    try:
      if self.step < config.train_steps:
        train_metrics = self.train(config.train_steps)
        self._save(self.step)
      eval_metrics = self.evaluate(self.step)
      export_dir = self._export()
    finally:
      self._summaries.close()
    return RunResult(step=self.step, eval_metrics=eval_metrics,
                     train_metrics=train_metrics,
                     checkpoint=self._last_checkpoint, export_dir=export_dir,
                     seconds=time.perf_counter() - started)

  @property
  def step(self):
    return int(self.global_step.numpy())

  def restore(self):
    """Restores the newest usable checkpoint in model_dir, if any."""
    restored = self._checkpoints.restore()
    if restored:
      logging.info("Resumed from %s at step %d.", restored, self.step)
      # The checkpoint holds the old rate; the flag given now wins.
      self.optimizer.learning_rate.assign(self._config.learning_rate)
    self._last_checkpoint = restored
    return restored

  def evaluate(self, step):
    """One pass over the test split (or eval_steps batches), exact."""
    sums = self._runner.evaluate(
        self._loops, data.eval_input_fn(
            self._dataset, global_batch_size=self._config.batch_size),
        self._eval_iterations)
    examples = max(float(sums["examples"]), 1.0)
    metrics = {"loss": float(sums["loss_sum"]) / examples,
               "accuracy": float(sums["correct"]) / examples,
               "examples": int(sums["examples"])}
    logging.info("eval  step %d: accuracy %.4f  loss %.4f  (%d examples)",
                 step, metrics["accuracy"], metrics["loss"],
                 metrics["examples"])
    self._summaries.scalars("eval", step, {k: metrics[k] for k in
                                           ("loss", "accuracy")})
    return metrics

  def evaluate_checkpoints(self, *, timeout_seconds):
    """Sidecar evaluator: evaluates each new checkpoint in model_dir until
    one at train_steps; returns the last metrics, or None on timeout."""
    metrics = None
    for path in tf.train.checkpoints_iterator(
        self._config.model_dir, min_interval_secs=1,
        timeout=timeout_seconds):
      try:
        self._checkpoints.restore_path(path)
      except checkpoints.UNREADABLE as e:
        logging.warning("Skipping unreadable checkpoint %s (%s).", path,
                        str(e).splitlines()[0][:160])
        continue
      metrics = self.evaluate(self.step)
      if self.step >= self._config.train_steps:
        break
    self._summaries.close()
    return metrics

  # The outer loop -----------------------------------------------------

  def _boundaries(self, step):
    config = self._config
    ends = [config.train_steps,
            _next_multiple(step, config.log_every)]
    for every in (config.eval_every, config.checkpoint_every,
                  config.check_replicas_every):
      if every:
        ends.append(_next_multiple(step, every))
    if config.profile_steps:
      ends.extend(s for s in config.profile_steps if s > step)
    return min(ends)

  def train(self, until_step):
    """Trains from the current step to `until_step`; returns the metrics of
    the last log interval. Evaluates and checkpoints on the way."""
    config = self._config
    step = self.step
    iterator = self._train_iterator(step)
    logging.info("Training %s on %s with %s: step %d -> %d, global batch "
                 "%d over %d replica(s).", config.model, self._dataset.name,
                 self._info.name, step, until_step, config.batch_size,
                 self._info.num_replicas)
    meter = _Meter(time.perf_counter(), config.batch_size)
    first_step, loop_started = step, time.perf_counter()
    metrics = {}
    while step < until_step:
      self._profile(step)
      num_steps = min(self._boundaries(step), until_step) - step
      sums = self._runner.run_steps(self._loops, iterator, num_steps,
                                    config.steps_per_loop)
      losses = sums["step_loss"]
      self._check_finite(losses, step)
      meter.add(sums, num_steps)
      step += num_steps
      self._iterator_step = step
      if step % config.log_every == 0 or step == until_step:
        metrics = meter.read(time.perf_counter())
        self._log_progress(step, until_step, metrics, first_step,
                           loop_started)
        meter.reset(time.perf_counter())
      every = config.check_replicas_every
      if every and (step % every == 0 or step == until_step):
        self._replica_checker.check(step)
      if step < until_step:
        if config.eval_every and step % config.eval_every == 0:
          self.evaluate(step)
          meter.reset(time.perf_counter())
        if config.checkpoint_every and step % config.checkpoint_every == 0:
          self._save(step)
    self._profile(step)
    return metrics

  def _train_iterator(self, step):
    """The input iterator positioned at `step`, reused across train calls."""
    if self._iterator is None or self._iterator_step != step:
      self._iterator = self._runner.make_iterator(data.train_input_fn(
          self._dataset, global_batch_size=self._config.batch_size,
          seed=self._config.seed if self._runner.same_data_everywhere
          else None, start_step=step))
      self._iterator_step = step
    return self._iterator

  def _profile(self, step):
    if not self._config.profile_steps:
      return
    start, end = self._config.profile_steps
    if start <= step < end:
      self._summaries.start_profile()
    elif step >= end:
      self._summaries.stop_profile()

  def _check_finite(self, losses, step):
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
      raise NonFiniteLossError(
          f"loss became {losses[bad[0]]} at step {step + bad[0] + 1}; "
          f"training stopped. Last good checkpoint kept: "
          f"{self._last_checkpoint or 'none'}.")

  def _save(self, step):
    self._last_checkpoint = self._checkpoints.save(step)
    logging.info("Saved checkpoint %s.", self._last_checkpoint)

  def _log_progress(self, step, total, metrics, first_step, loop_started):
    elapsed = time.perf_counter() - loop_started
    rate = (step - first_step) / max(elapsed, 1e-9)
    eta = datetime.timedelta(seconds=round((total - step) / max(rate, 1e-9)))
    logging.info("train step %d/%d: loss %.4f  accuracy %.4f  %.0f "
                 "examples/s  ETA %s", step, total, metrics["loss"],
                 metrics["accuracy"], metrics["examples_per_sec"], eta)
    self._summaries.scalars("train", step, {
        **metrics, "learning_rate": float(tf.convert_to_tensor(
            self.optimizer.learning_rate.value))})

  def _log_placement(self):
    """Bytes of model variables per parameter server."""
    per_task = {}
    for weight in self.model.weights:
      device = tf.DeviceSpec.from_string(weight.value.device)
      task = f"{device.job}:{device.task}"
      per_task.setdefault(task, [0, []])
      per_task[task][0] += int(np.prod(weight.shape)) * weight.value.dtype.size
      per_task[task][1].append(weight.path)
    for task, (size, names) in sorted(per_task.items()):
      logging.info("placement %s: %d bytes in %d variable(s): %s", task, size,
                   len(names), ", ".join(names))

  def _export(self):
    if not self._config.export:
      return None
    # Every worker exports (saving may need collectives); only the chief's
    # write_dir is model_dir.
    export_dir = os.path.join(self._write_dir, "export")
    export.export_saved_model(self.model, input_shape=self._dataset.input_shape,
                              export_dir=export_dir)
    logging.info("Exported SavedModel to %s.", export_dir)
    return export_dir
