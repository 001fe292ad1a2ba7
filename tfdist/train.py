"""python -m tfdist.train: the CLI. The only module that reads FLAGS."""

import os
import sys

from absl import app
from absl import flags
from absl import logging

from tfdist import cluster
from tfdist import config as config_lib
from tfdist.errors import TfdistError

FLAGS = flags.FLAGS

flags.DEFINE_enum("strategy", "auto", config_lib.STRATEGIES,
                  "tf.distribute strategy; auto picks from TF_CONFIG and the "
                  "visible devices.")
flags.DEFINE_string("model", "mlp", "Model name from the zoo (models/).")
flags.DEFINE_string("dataset", "digits",
                    "digits (offline), synthetic, or a tfds catalog name.")
flags.DEFINE_string("data_dir", "~/tensorflow_datasets", "tfds data_dir.")
flags.DEFINE_string("model_dir", None,
                    "Checkpoints, TensorBoard events and the export.")
flags.DEFINE_integer("batch_size", 64, "GLOBAL batch size (all replicas).")
flags.DEFINE_integer("train_steps", 300, "Total training steps.")
flags.DEFINE_enum("optimizer", "adam", config_lib.OPTIMIZERS, "Optimizer.")
flags.DEFINE_float("learning_rate", 1e-3, "Learning rate.")
flags.DEFINE_integer("eval_every", 100, "Eval every N steps; 0: at the end "
                     "only.")
flags.DEFINE_integer("eval_steps", 0, "Eval batches; 0: the whole test split.")
flags.DEFINE_integer("checkpoint_every", 100, "Checkpoint every N steps; 0: "
                     "at the end only.")
flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept in model_dir.")
flags.DEFINE_integer("steps_per_loop", 50, "Steps per tf.function call.")
flags.DEFINE_integer("log_every", 50, "Print a progress line every N steps.")
flags.DEFINE_integer("num_cpu_devices", 1,
                     "Split the host CPU into N logical devices.")
flags.DEFINE_integer("num_replicas", 0,
                     "mirrored: use the first N local devices; 0: all.")
flags.DEFINE_enum("mixed_precision", "none", config_lib.MIXED_PRECISION,
                  "Keras mixed-precision policy.")
flags.DEFINE_integer("seed", 42, "Seed for weights and data order.")
flags.DEFINE_string("tpu", "local", "TPU address for --strategy=tpu.")
flags.DEFINE_list("profile_steps", [], "START,END: profile these steps.")
flags.DEFINE_list("synthetic_shape", ["8", "8", "1"],
                  "Input shape of --dataset=synthetic.")
flags.DEFINE_integer("synthetic_classes", 10, "Classes of synthetic data.")
flags.DEFINE_boolean("export", True, "Export a SavedModel at the end.")
flags.DEFINE_boolean("jit_compile", False,
                     "XLA-compile each replica's train and eval step.")
flags.DEFINE_enum("all_reduce_alg", "auto", config_lib.ALL_REDUCE_ALGS,
                  "multi_worker_mirrored: collective implementation.")
flags.DEFINE_integer("bytes_per_pack", 0,
                     "multi_worker_mirrored: pack gradients into chunks of "
                     "this many bytes per all-reduce; 0: one pack.")
flags.DEFINE_float("collective_timeout", 0.0,
                   "multi_worker_mirrored: seconds before a collective that "
                   "a peer does not answer fails; 0: no timeout.")
flags.DEFINE_enum("allreduce_dtype", "float32", config_lib.ALLREDUCE_DTYPES,
                  "All-reduce gradients in this dtype (compression).")
flags.DEFINE_integer("check_replicas_every", 0,
                     "Every N steps, check that all replicas hold identical "
                     "weights; 0: never.")
flags.DEFINE_integer("ps_shard_min_bytes", 256 << 10,
                     "parameter_server: split variables into shards of at "
                     "least this many bytes; 0: --ps_max_shards fixed "
                     "shards.")
flags.DEFINE_integer("ps_max_shards", 0,
                     "parameter_server: most shards per variable; 0: the "
                     "number of ps tasks.")
flags.DEFINE_float("sidecar_timeout", 600.0,
                   "evaluator task: give up when no new checkpoint appears "
                   "for this many seconds.")
flags.DEFINE_enum("model_parallel", "none", config_lib.MODEL_PARALLEL,
                  "Split each replica's model over local devices: pipeline "
                  "stages or tensor-parallel layers.")
flags.DEFINE_integer("num_stages", 2, "pipeline: number of stages.")
flags.DEFINE_integer("tensor_parallel", 2,
                     "tensor: devices each split layer spans.")
flags.DEFINE_integer("num_microbatches", 1,
                     "pipeline: micro-batches per replica batch (GPipe).")
flags.DEFINE_string("placement", "",
                    "pipeline: 'pattern=device;...' or a JSON file "
                    "{pattern: device}; empty: balanced automatic stages.")
flags.DEFINE_enum("cluster", "env", ["env", "slurm"],
                  "Where the cluster comes from: TF_CONFIG (env), or "
                  "Slurm's srun environment (slurm).")
flags.DEFINE_integer("ps_tasks", 0,
                     "--cluster=slurm: the first N tasks are parameter "
                     "servers and the next is the chief.")
flags.DEFINE_integer("cluster_port", 0,
                     "--cluster=slurm: first task port on each node; 0: "
                     "derived from the job id.")
flags.DEFINE_boolean("native_logs", False,
                     "Show TensorFlow's native start-up logs (also on with "
                     "--verbosity>=1).")


def _int_tuple(name, values):
  try:
    return tuple(int(v) for v in values)
  except ValueError:
    raise TfdistError(f"--{name} takes integers. Received: "
                      f"{name}={','.join(values)}") from None


def config_from_flags():
  """Turns FLAGS into a frozen, validated Config."""
  profile = _int_tuple("profile_steps", FLAGS.profile_steps)
  if profile and len(profile) != 2:
    raise TfdistError("--profile_steps takes START,END. Received: "
                      f"profile_steps={FLAGS.profile_steps}")
  return config_lib.Config(
      strategy=FLAGS.strategy, model=FLAGS.model, dataset=FLAGS.dataset,
      data_dir=FLAGS.data_dir, model_dir=FLAGS.model_dir,
      batch_size=FLAGS.batch_size, train_steps=FLAGS.train_steps,
      optimizer=FLAGS.optimizer, learning_rate=FLAGS.learning_rate,
      eval_every=FLAGS.eval_every, eval_steps=FLAGS.eval_steps,
      checkpoint_every=FLAGS.checkpoint_every,
      keep_checkpoints=FLAGS.keep_checkpoints,
      steps_per_loop=FLAGS.steps_per_loop, log_every=FLAGS.log_every,
      num_cpu_devices=FLAGS.num_cpu_devices,
      num_replicas=FLAGS.num_replicas,
      mixed_precision=FLAGS.mixed_precision, seed=FLAGS.seed, tpu=FLAGS.tpu,
      profile_steps=profile or None,
      synthetic_shape=_int_tuple("synthetic_shape", FLAGS.synthetic_shape),
      synthetic_classes=FLAGS.synthetic_classes, export=FLAGS.export,
      jit_compile=FLAGS.jit_compile, all_reduce_alg=FLAGS.all_reduce_alg,
      bytes_per_pack=FLAGS.bytes_per_pack,
      collective_timeout=FLAGS.collective_timeout,
      allreduce_dtype=FLAGS.allreduce_dtype,
      check_replicas_every=FLAGS.check_replicas_every,
      ps_shard_min_bytes=FLAGS.ps_shard_min_bytes,
      ps_max_shards=FLAGS.ps_max_shards,
      sidecar_timeout=FLAGS.sidecar_timeout,
      model_parallel=FLAGS.model_parallel, num_stages=FLAGS.num_stages,
      tensor_parallel=FLAGS.tensor_parallel,
      num_microbatches=FLAGS.num_microbatches, placement=FLAGS.placement)


def _fail(message, exit_code=2):
  sys.stderr.write(f"tfdist: error: {message}\n")
  sys.exit(exit_code)


def _parse_flags(argv):
  try:
    return FLAGS(argv)
  except flags.Error as e:
    _fail(str(e).splitlines()[0].removeprefix("ERROR:: "))


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OUR_PACKAGES = tuple(os.path.join(_ROOT, name, "")
                      for name in ("tfdist", "models", "launch", "tools"))


def _ours_or_warning(record):
  """Hides other libraries' INFO chatter (tfds, tf.distribute) by default."""
  return (record.levelno >= logging.converter.STANDARD_WARNING or
          record.pathname.startswith(_OUR_PACKAGES))


def _setup_logging(verbose):
  handler = logging.get_absl_handler().python_handler
  handler.setFormatter(_ShortFormatter())
  if not verbose:
    handler.addFilter(_ours_or_warning)


class _ShortFormatter(logging.PythonFormatter):
  def format(self, record):
    stamp = self.formatTime(record, "%H:%M:%S")
    level = "" if record.levelname == "INFO" else record.levelname + ": "
    return f"{stamp} {level}{record.getMessage()}"


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}")
  show_native = FLAGS.native_logs or FLAGS.verbosity >= 1
  _setup_logging(verbose=show_native)
  # The one environment write: quiet TF's runtime logs unless asked not to.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if show_native else "2")
  try:
    config = config_from_flags()
    from tfdist import run  # pylint: disable=g-import-not-at-top
    result = run.run(config, tf_config=_cluster_from_flags(),
                     show_native_logs=show_native)
  except TfdistError as e:
    _fail(str(e), e.exit_code)
  if result is None:  # A serving task (ps, PS worker) or the evaluator.
    return
  for line in run.summary_lines(config, result):
    print(line, flush=True)


def _cluster_from_flags():
  if FLAGS.cluster == "slurm":
    return cluster.tf_config_from_slurm(
        os.environ, ps_tasks=FLAGS.ps_tasks, base_port=FLAGS.cluster_port)
  return cluster.tf_config_from_env(os.environ)


def run_cli():
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run_cli()
