"""The Python API, `tfdist.train(...)`, and the start-up of one task.

    import tfdist
    result = tfdist.train(MyTask(), model_dir="runs/mine", strategy="mirrored",
                          num_cpu_devices=2)

The CLI (python -m tfdist.train) is a thin wrapper over `run`. Start-up
order matters: a multi-worker strategy must exist before any other
TensorFlow op runs, so the task's role is decided from TF_CONFIG first,
then TensorFlow starts, then the strategy, and only then is user code
(the task) imported and built.
"""

import contextlib
import dataclasses
import enum
import shutil
import tempfile

from absl import logging

from tfdist import config as config_lib
from tfdist import errors
from tfdist import malloc_arenas
from tfdist import quiet
from tfdist.errors import ConfigError
from tfdist.errors import PORT_TAKEN_EXIT_CODE
from tfdist.errors import PortTakenError
from tfdist.errors import TfdistError


class Role(enum.Enum):
  TRAINER = "trainer"  # Trains: the chief, an MWMS worker, a lone process.
  SERVER = "server"  # A ps or worker task of a parameter-server job.
  EVALUATOR = "evaluator"  # A sidecar evaluator.


def role_of(config, tf_config):
  """This task's role, decided once from the Config and TF_CONFIG."""
  if config.mode in ("eval", "continuous_eval"):
    return Role.EVALUATOR
  if tf_config is None:
    return Role.TRAINER
  if tf_config.task_type == "evaluator":
    return Role.EVALUATOR
  if (tf_config.task_type in ("ps", "worker") and tf_config.cluster.get("ps")
      and config.strategy in ("parameter_server", "auto")):
    return Role.SERVER
  return Role.TRAINER


def check_before_tensorflow(config, role, *, task, tf_config):
  """What the Config and TF_CONFIG alone refuse, checked before TF's
  import (6-7 s here) and before model_dir is touched: a zoo model's
  name, and a parameter-server trainer outside a PS cluster."""
  from tfdist import models  # pylint: disable=g-import-not-at-top
  from tfdist import strategies  # pylint: disable=g-import-not-at-top
  from tfdist import task as task_lib  # pylint: disable=g-import-not-at-top
  if (task is None and not config.task
      and not task_lib.is_reference(config.model)):
    models.check_name(config.model)
  if role is Role.TRAINER and config.strategy == "parameter_server":
    strategies.check_parameter_server_task(tf_config)
  if role is Role.TRAINER and config.data_service:
    from tfdist import service_address  # pylint: disable=g-import-not-at-top
    service_address.check_reachable(config.data_service,
                                    wait_seconds=config.data_service_wait)


def ensure_writable_dir(path):
  """Creates model_dir if needed and proves a file can be written in it."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist import storage  # pylint: disable=g-import-not-at-top
  try:
    storage.ensure_writable(path)
  except (OSError, tf.errors.OpError) as e:
    reason = getattr(e, "message", None) or getattr(e, "strerror", None) or e
    raise TfdistError(f"model_dir {path} is not writable: "
                      f"{errors.first_line(reason, 200)}") from None


@contextlib.contextmanager
def process_settings(config):
  """Keras's process-wide mixed-precision policy and seed, for one run;
  the caller's policy comes back afterwards."""
  import keras
  previous = keras.mixed_precision.global_policy().name
  keras.mixed_precision.set_global_policy(
      "float32" if config.mixed_precision == "none"
      else config.mixed_precision)
  keras.utils.set_random_seed(config.seed)
  try:
    yield
  finally:
    keras.mixed_precision.set_global_policy(previous)


def start_tensorflow(config, role, *, tf_config=None,
                     show_native_logs=False):
  """Imports TF, splits the CPU and creates what this role needs, in that
  order: the started server (SERVER) or the StrategyInfo."""
  arenas = malloc_arenas.count(config)
  if malloc_arenas.limit(arenas):  # Before TF starts its threads.
    logging.info("malloc arenas: at most %d (--malloc_arenas).", arenas)
  with quiet.native_stderr_captured(enabled=not show_native_logs):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist import strategies  # pylint: disable=g-import-not-at-top
    import tensorflow_datasets  # noqa: F401  (its import warns on stderr)
    strategies.configure_cpu_devices(config.num_cpu_devices)
    try:
      if role is Role.SERVER:
        from tfdist import ps_server  # pylint: disable=g-import-not-at-top
        return ps_server.start_server(tf_config)
      if role is Role.EVALUATOR:
        # The sidecar evaluator trains nothing: one local device, no
        # cluster.
        info = strategies.create_strategy(
            dataclasses.replace(config, strategy="default"))
        # The variables must be split as the trainer split them, or the
        # checkpoint's shards would not fit.
        num_ps = len(tf_config.cluster.get("ps", {})) if tf_config else 0
        info = dataclasses.replace(
            info, reason="sidecar evaluator",
            partitioner=(strategies.partitioner(config, num_ps)
                         if num_ps else None))
      else:
        info = strategies.create_strategy(config, tf_config=tf_config)
    except tf.errors.UnknownError as e:
      if "Could not start gRPC server" not in str(e):
        raise
      raise PortTakenError(
          f"could not start this task's gRPC server at "
          f"{tf_config.address if tf_config else '?'}: the port is taken "
          f"(exit code {PORT_TAKEN_EXIT_CODE}: launchers relaunch with new "
          "ports).") from None
    tf.config.list_logical_devices()
  logging.info("Strategy: %s (%s), %d replica(s)%s.", info.name, info.reason,
               info.num_replicas,
               f", {info.num_workers} workers" if info.coordinator else "")
  return info


def run(config, *, task=None, tf_config=None, show_native_logs=False,
        callbacks=None):
  """Runs this task of the job; returns the Trainer's RunResult, or None
  for a ps/worker server or a sidecar evaluator."""
  role = role_of(config, tf_config)
  check_before_tensorflow(config, role, task=task, tf_config=tf_config)
  started = start_tensorflow(config, role, tf_config=tf_config,
                             show_native_logs=show_native_logs)
  ensure_writable_dir(config.model_dir)
  if role is Role.SERVER:
    from tfdist import ps_server  # pylint: disable=g-import-not-at-top
    del started  # This task's tf.distribute.Server: it serves meanwhile.
    ps_server.serve_until_chief_done(tf_config)
    return None
  info = started
  from tfdist import builder  # pylint: disable=g-import-not-at-top
  # Non-chief workers write to a scratch dir that is removed afterwards.
  write_dir = (config.model_dir if info.is_chief else
               tempfile.mkdtemp(prefix=f"tfdist-worker{info.worker_index}-"))
  from tfdist import runners  # pylint: disable=g-import-not-at-top
  try:
    # A peer lost while the trainer is built (its variables' first
    # values come from worker 0 by collectives) is a lost peer as well.
    with runners.peer_losses_named(info.task_name, info.peers):
      with process_settings(config):
        task = builder.resolve_task(config, info, task)
        if role is Role.EVALUATOR:
          evaluator = builder.build_evaluator(config, info, task,
                                              write_dir=write_dir)
        else:
          trainer = builder.build_trainer(
              config, info, task, write_dir=write_dir,
              callbacks=builder.resolve_callbacks(config, callbacks))
      if role is Role.EVALUATOR and config.mode == "eval":
        return evaluator.evaluate_once(config.checkpoint or None)
      if role is Role.EVALUATOR:
        return _run_sidecar(evaluator, config)
      return trainer.run()
  finally:
    if write_dir != config.model_dir:
      shutil.rmtree(write_dir, ignore_errors=True)


def _run_sidecar(evaluator, config):
  logging.info("%s: watching %s for checkpoints up to step %d.",
               ("Continuous eval" if config.mode == "continuous_eval"
                else "Sidecar evaluator"), config.model_dir,
               config.train_steps)
  metrics = evaluator.evaluate_checkpoints(
      timeout_seconds=config.sidecar_timeout)
  if metrics is None:
    raise TfdistError(f"sidecar evaluator: no checkpoint at step "
                      f"{config.train_steps} appeared in {config.model_dir} "
                      f"within {config.sidecar_timeout:g}s.")
  logging.info("Sidecar evaluator done at step %d.", evaluator.step)
  return None


def train(task_or_config=None, *, tf_config=None, callbacks=None,
          **options):
  """Trains like `python -m tfdist.train`, in this process.

  `task_or_config` is a tfdist.Task, a tfdist Config, or None (the options
  alone, e.g. model="mlp", dataset="digits"). Keyword options are the CLI's
  flags without dashes; they override the Config's. `tf_config` is a parsed
  tfdist.cluster.TaskConfig, or None for one process. `callbacks`: Keras
  callbacks (keras.callbacks.Callback objects), run on the chief at each
  loop call and each eval (tfdist.callbacks). Returns the
  RunResult (step, eval_metrics, train_metrics, checkpoint, export_dir).
  """
  from tfdist import task as task_lib  # pylint: disable=g-import-not-at-top
  task = None
  if isinstance(task_or_config, config_lib.Config):
    config = dataclasses.replace(task_or_config, **options)
  elif task_or_config is None or isinstance(task_or_config, task_lib.Task):
    task = task_or_config
    unknown = sorted(set(options) - {f.name for f in
                                     dataclasses.fields(config_lib.Config)})
    if unknown:
      raise ConfigError(f"Unrecognized option(s): {', '.join(unknown)}")
    config = config_lib.Config(**options)
  else:
    raise ConfigError("tfdist.train takes a tfdist.Task, a Config or None. "
                      f"Received: a {type(task_or_config).__name__}")
  return run(config, task=task, tf_config=tf_config,
             show_native_logs=config.native_logs, callbacks=callbacks)


def summary_lines(config, result):
  """The closing lines printed after a run."""
  evals = result.eval_metrics
  names = [k for k in evals if k not in ("loss", "examples")] + (
      ["loss"] if evals else [])
  shown = ", ".join(f"eval {k} {evals[k]:.4f}" for k in names)
  if config.mode == "eval":
    return [f"Evaluated {result.checkpoint} (step {result.step}): {shown} "
            f"({evals['examples']} examples).",
            f"  tensorboard: tensorboard --logdir {config.model_dir}"]
  if not evals:
    shown = "no eval (--mode=train)"
  else:
    shown += f" ({evals['examples']} examples)"
  return [
      f"Finished at step {result.step}/{config.train_steps} in "
      f"{result.seconds:.1f}s: {shown}.",
      f"  checkpoint:  {result.checkpoint}",
      f"  export:      {result.export_dir or '(not exported)'}",
      f"  tensorboard: tensorboard --logdir {config.model_dir}",
  ]
