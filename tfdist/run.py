"""Runs one training job from a Config: devices, strategy, data, Trainer."""

import dataclasses
import os
import shutil
import tempfile

from absl import logging

from tfdist import quiet
from tfdist.errors import TfdistError


def ensure_writable_dir(path):
  """Creates `path` if needed and proves a file can be written in it."""
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".tfdist-probe-"):
      pass
  except OSError as e:
    raise TfdistError(f"model_dir {path} is not writable: "
                      f"{e.strerror or e}") from None


def start_tensorflow(config, *, tf_config=None, show_native_logs=False):
  """Imports TF, splits the CPU and creates the strategy, in that order.

  A multi-worker strategy must exist before any other TF op runs, so
  nothing else may touch the runtime before this returns. Returns the
  StrategyInfo, or, for a ps/worker task of a PS job, its started Server.
  """
  with quiet.native_stderr_captured(enabled=not show_native_logs):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist import strategies  # pylint: disable=g-import-not-at-top
    import tensorflow_datasets  # noqa: F401  (its import warns on stderr)
    strategies.configure_cpu_devices(config.num_cpu_devices)
    if _is_ps_server(config, tf_config):
      from tfdist import ps_server  # pylint: disable=g-import-not-at-top
      return ps_server.start_server(tf_config)
    evaluator = _is_evaluator(tf_config)
    if evaluator:
      # The sidecar evaluator trains nothing: one local device, no cluster.
      config, tf_config = dataclasses.replace(config, strategy="default"), None
    info = strategies.create_strategy(config, tf_config=tf_config)
    if evaluator:
      info = dataclasses.replace(info, reason="sidecar evaluator")
    tf.config.list_logical_devices()
  logging.info("Strategy: %s (%s), %d replica(s)%s.", info.name, info.reason,
               info.num_replicas,
               f", {info.num_workers} workers" if info.coordinator else "")
  return info


def _is_evaluator(tf_config):
  return tf_config is not None and tf_config.task_type == "evaluator"


def _is_ps_server(config, tf_config):
  """ps and worker tasks of a parameter-server job only serve."""
  return (tf_config is not None and tf_config.task_type in ("ps", "worker")
          and tf_config.cluster.get("ps") and
          config.strategy in ("parameter_server", "auto"))


def run(config, *, tf_config=None, show_native_logs=False):
  """Trains per `config`; returns the Trainer's RunResult, or None for the
  ps and worker tasks of a parameter-server job, which only serve."""
  import models  # pylint: disable=g-import-not-at-top
  models.check_name(config.model)
  ensure_writable_dir(config.model_dir)
  info = start_tensorflow(config, tf_config=tf_config,
                          show_native_logs=show_native_logs)
  if _is_ps_server(config, tf_config):
    from tfdist import ps_server  # pylint: disable=g-import-not-at-top
    # `info` is this task's tf.distribute.Server: it serves while we wait.
    ps_server.serve_until_chief_done(tf_config)
    return None
  from tfdist import data  # pylint: disable=g-import-not-at-top
  from tfdist import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  trainer_lib.check_batch_size(config.batch_size, info.num_replicas)
  dataset = data.load(config)
  # Non-chief workers write to a scratch dir that is removed afterwards.
  write_dir = (config.model_dir if info.is_chief else
               tempfile.mkdtemp(prefix=f"tfdist-worker{info.worker_index}-"))
  try:
    trainer = trainer_lib.Trainer(config=config, strategy_info=info,
                                  dataset=dataset, write_dir=write_dir)
    if _is_evaluator(tf_config):
      return _run_sidecar(trainer, config)
    return trainer.run()
  finally:
    if write_dir != config.model_dir:
      shutil.rmtree(write_dir, ignore_errors=True)


def _run_sidecar(trainer, config):
  logging.info("Sidecar evaluator: watching %s for checkpoints up to step "
               "%d.", config.model_dir, config.train_steps)
  metrics = trainer.evaluate_checkpoints(
      timeout_seconds=config.sidecar_timeout)
  if metrics is None:
    raise TfdistError(f"sidecar evaluator: no checkpoint at step "
                      f"{config.train_steps} appeared in {config.model_dir} "
                      f"within {config.sidecar_timeout:g}s.")
  logging.info("Sidecar evaluator done at step %d.", trainer.step)
  return None


def summary_lines(config, result):
  """The closing lines printed after a run."""
  evals = result.eval_metrics
  return [
      f"Finished at step {result.step}/{config.train_steps} in "
      f"{result.seconds:.1f}s: eval accuracy {evals['accuracy']:.4f}, "
      f"eval loss {evals['loss']:.4f} ({evals['examples']} examples).",
      f"  checkpoint:  {result.checkpoint}",
      f"  export:      {result.export_dir or '(not exported)'}",
      f"  tensorboard: tensorboard --logdir {config.model_dir}",
  ]
