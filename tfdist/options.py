"""Every run option, defined once: name, default, help, section and check.

The absl flags (tfdist.train), the frozen Config (tfdist.config), the
HParams log and docs/flags.md's flag table all come from OPTIONS. Adding an
option means adding one Option here. No TensorFlow import: flags are
checked before TensorFlow starts.
"""

import dataclasses
from typing import Any, Optional, Tuple

from tfdist import optimizers
from tfdist import service_address
from tfdist import strategies

# Sections, in the order --helpfull shows them.
SECTIONS = ("run", "task", "optimization", "loop", "output",
            "multi_worker", "parameter_server", "model_parallel", "cluster")

# The main flags of each section: what --help lists (--helpfull lists all).
KEY_OPTIONS = ("model_dir", "mode", "strategy", "num_cpu_devices", "task",
               "model", "dataset", "data_dir", "optimizer", "learning_rate",
               "batch_size", "train_steps", "eval_every", "checkpoint_every",
               "export", "best_metric", "allreduce_compression",
               "ps_shard_min_bytes", "model_parallel", "cluster")

MIXED_PRECISION = ("none", "mixed_float16", "mixed_bfloat16")
LR_SCHEDULES = ("constant", "cosine", "linear", "step")
SHARD_STAGES = ("none", "optimizer", "gradients", "params")


@dataclasses.dataclass(frozen=True)
class Option:
  """One option. `kind` is str, int, float, bool, enum or ints (a list of
  integers); `minimum`/`above` bound numbers (>= and >)."""

  name: str
  default: Any
  help: str
  section: str
  kind: str = "str"
  choices: Tuple[str, ...] = ()
  minimum: Optional[float] = None
  above: Optional[float] = None

  def check(self, value):
    """Returns an error message for a bad value, else None."""
    wrong_type = _type_error(self, value)
    if wrong_type:
      return wrong_type
    if self.kind == "enum" and value not in self.choices:
      return (f"Unrecognized {self.name}: {value!r}. "
              f"Valid: {', '.join(self.choices)}.")
    if self.kind == "ints":
      if value is None:
        return None
      numbers = value
    elif self.kind in ("int", "float"):
      numbers = (value,)
    else:
      return None
    shown = ",".join(str(v) for v in numbers)
    for number in numbers:
      # TensorFlow takes int32 sizes and finite floats.
      if not -_LARGEST <= number <= _LARGEST:
        return (f"{self.name} must be a finite number of magnitude at most "
                f"{_LARGEST}. Received: {self.name}={shown}")
      if self.above is not None and not number > self.above:
        return (f"{self.name} must be > {self.above:g}. "
                f"Received: {self.name}={shown}")
      if self.minimum is not None and not number >= self.minimum:
        return (f"{self.name} must be >= {self.minimum:g}. "
                f"Received: {self.name}={shown}")
    return None


_LARGEST = 2**31 - 1
_TYPES = {"str": (str,), "enum": (str,), "bool": (bool,), "int": (int,),
          "float": (int, float)}


def _type_error(option, value):
  if option.kind == "ints":
    ok = value is None or (isinstance(value, (tuple, list)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value))
    wanted = "a list of integers"
  else:
    types = _TYPES[option.kind]
    ok = isinstance(value, types) and (
        option.kind == "bool" or not isinstance(value, bool))
    wanted = {"str": "a string", "enum": "a string", "bool": "True or False",
              "int": "an integer", "float": "a number"}[option.kind]
  if ok:
    return None
  return f"{option.name} takes {wanted}. Received: {option.name}={value!r}"


def _o(name, default, help_text, section, kind=None, **bounds):
  if kind is None:
    kind = {bool: "bool", int: "int", float: "float"}.get(type(default),
                                                           "str")
  return Option(name, default, help_text, section, kind, **bounds)


def _enum(name, default, choices, help_text, section):
  return Option(name, default, help_text, section, "enum", tuple(choices))


MODES = ("train_and_eval", "train", "eval", "continuous_eval")

OPTIONS = (
    # run
    _o("model_dir", "", "Checkpoints, TensorBoard events and the export "
       "(required).", "run"),
    _enum("mode", "train_and_eval", MODES,
          "train_and_eval: train, evaluating every --eval_every steps and "
          "at the end. train: no evals. eval: evaluate the latest "
          "checkpoint in model_dir (or --checkpoint) once, write its eval "
          "events, change nothing else. continuous_eval: evaluate each new "
          "checkpoint until one at --train_steps (the sidecar evaluator's "
          "work, without a TF_CONFIG).", "run"),
    _o("checkpoint", "", "--mode=eval: evaluate this checkpoint (a "
       "model_dir/ckpt-N prefix) instead of the latest.", "run"),
    _o("init_checkpoint", "", "Warm start: the model weights (only) from "
       "this tfdist checkpoint (ckpt-N prefix or directory), .weights.h5 "
       "or .keras file, at step 0. Ignored when model_dir holds "
       "checkpoints (the run resumes).", "run"),
    _o("init_checkpoint_skip", "", "A regular expression: variables whose "
       "path matches it (e.g. dense_2, a new head) keep their initial "
       "values in a warm start.", "run"),
    _o("callbacks", "", "package.module:function returning a list of "
       "keras.callbacks.Callback objects, run on the chief at each loop "
       "call (on_train_batch_end) and each eval (on_epoch_end, with "
       "val_<metric> logs).", "run"),
    _enum("strategy", "auto", ("auto", *strategies.NAMES),
          "tf.distribute strategy; auto picks from TF_CONFIG and the "
          "visible devices.", "run"),
    _o("num_cpu_devices", 1, "Split the host CPU into N logical devices.",
       "run", above=0),
    _o("num_replicas", 0, "mirrored: use the first N local devices; 0: all.",
       "run", minimum=0),
    _enum("mixed_precision", "none", MIXED_PRECISION,
          "Keras mixed-precision policy.", "run"),
    _o("seed", 42, "Seed for weights and data order.", "run"),
    _o("malloc_arenas", 0, "glibc: the most malloc arenas this process's "
       "threads share; memory one arena frees is not reused by another, "
       "so more arenas mean a higher peak. 0: 2 with --shard=params, else "
       "glibc's default (8 per core).", "run", minimum=0),
    _o("tpu", "local", "TPU address for --strategy=tpu.", "run"),
    _o("native_logs", False, "Show TensorFlow's native start-up logs (also "
       "on with --verbosity>=1).", "run"),
    # task: what is trained
    _o("task", "", "A user task, package.module:Name (a tfdist.Task "
       "subclass or a function returning one); overrides --model/--dataset.",
       "task"),
    _o("model", "mlp", "A zoo model (mlp, mlp_wide, cnn, resnet20, "
       "resnet56, transformer, embedding_bag) or package.module:function "
       "returning a Keras model.", "task"),
    _o("dataset", "digits", "digits (offline), synthetic, a tfds catalog "
       "name, or package.module:function returning (train, eval) datasets.",
       "task"),
    _o("data_dir", "~/tensorflow_datasets", "tfds data_dir.", "task"),
    _enum("input_sharding", "auto", ("batch", "file", "auto"),
          "How hosts split the training data. batch: every host reads all "
          "of it and keeps 1/N of each global batch (the same batches on any "
          "host count). file: each host reads only its own files, 1/N of "
          "the bytes. auto: file for data streamed from files (a "
          "tfdist.FileData, a large tfds dataset, a pipeline of your own "
          "whose files TF's auto-shard rewrite finds) when there are at "
          "least as many files as hosts; batch otherwise.", "task"),
    _o("cache", "auto", "What is cached of data read from files. auto: in "
       "memory when its files take at most 64 MiB, else streamed. memory, "
       "off, or a path prefix for cache files (one per host and split). "
       "Data in memory (arrays) is always cached; augmentation runs after "
       "the cache.", "task"),
    _o("shuffle_buffer", 10_000, "Examples shuffled together: a shuffle "
       "buffer, or for data streamed from files a window of records "
       "(held serialized, after the file order is shuffled each epoch; "
       "the next window is read meanwhile: two in memory).",
       "task", above=0),
    _o("data_service", "", "grpc://HOST:PORT of a tf.data service "
       "dispatcher: the train pipeline, up to and including batching, runs "
       "on its data workers (launch.local --data_workers=K starts them). "
       "Eval stays on the trainers.", "task"),
    _o("data_service_wait", service_address.REACH_SECONDS, "Seconds a "
       "trainer waits at its start for the --data_service dispatcher to "
       "answer before it gives up (a launcher may be starting it).",
       "task", minimum=0),
    _enum("data_service_mode", "dynamic", service_address.MODES,
          "How the data workers split the train stream. dynamic: each "
          "slice of an epoch goes to one data worker (an epoch is read once; "
          "a lost data worker loses the rest of its slice). "
          "parallel_epochs: every data worker reads all of it, in an order "
          "of its own.", "task"),
    _o("synthetic_shape", (8, 8, 1), "Input shape of --dataset=synthetic.",
       "task", "ints", above=0),
    _o("synthetic_classes", 10, "Classes of --dataset=synthetic.", "task",
       above=0),
    _o("class_weight", "", "CLASS:WEIGHT,... for integer labels, as Keras "
       "fit's class_weight: each training example's loss and metrics are "
       "weighted by its class's weight (classes left out weigh 1); evals "
       "are not.", "task"),
    # optimization
    _enum("optimizer", "adam", optimizers.NAMES, "Optimizer.",
          "optimization"),
    _o("learning_rate", 1e-3, "Peak learning rate.", "optimization",
       minimum=0),
    _enum("lr_schedule", "constant", LR_SCHEDULES,
          "Learning-rate schedule after the warmup: constant, cosine or "
          "linear decay to --end_learning_rate over --decay_steps, or step "
          "(x0.1 every --decay_steps).", "optimization"),
    _o("warmup_steps", 0, "Linear warmup from 0 over this many steps.",
       "optimization", minimum=0),
    _o("decay_steps", 0, "Steps of decay after the warmup; 0: to "
       "--train_steps.", "optimization", minimum=0),
    _o("end_learning_rate", 0.0, "Learning rate at the end of the decay.",
       "optimization", minimum=0),
    _o("clip_norm", 0.0, "Clip gradients to this global norm after the "
       "all-reduce; 0: no clipping.", "optimization", minimum=0),
    _o("weight_decay", 0.0, "Decoupled weight decay (the optimizer's "
       "weight_decay).", "optimization", minimum=0),
    _o("ema_decay", 0.0, "Keep an exponential moving average of the "
       "weights with this decay (Keras's use_ema, ema_momentum); eval and "
       "the export use it, checkpoints save it. 0: off.", "optimization",
       minimum=0),
    _o("sync_batchnorm", False, "BatchNormalization layers use the "
       "statistics of the global batch, all-reduced across replicas (Keras "
       "BN's synchronized=True), so N replicas train as one device would. "
       "Synchronous strategies only.", "optimization"),
    _o("grad_accum_steps", 1, "Run each replica's batch as K micro-batches "
       "and sum their gradients before the one update.", "optimization",
       above=0),
    _enum("shard", "none", SHARD_STAGES, "What each of N replicas keeps "
          "1/N of (ZeRO): optimizer (its state; the gradients are "
          "reduce-scattered, so no replica holds their sum either), "
          "gradients (the same update: stage 1 here already has stage 2's "
          "gradient shards), params (the weights too, gathered a layer at a "
          "time: fully sharded data parallelism). Checkpoints hold the whole "
          "state, as an unsharded run lays it out. mirrored and "
          "multi_worker_mirrored.", "optimization"),
    _o("shard_optimizer", False, "The same as --shard=optimizer.",
       "optimization"),
    _o("reshard_after_forward", True, "--shard=params: a layer's gathered "
       "weights are dropped after its forward pass and gathered again for "
       "its backward (1.5x the bytes of an all-reduce); false: kept until "
       "its backward (1.0x the bytes; the whole weights are alive through "
       "the step).", "optimization"),
    _o("batch_size", 64, "GLOBAL batch size of one update (all replicas).",
       "optimization", above=0),
    # loop
    _o("train_steps", 300, "Total training steps.", "loop", above=0),
    _o("steps_per_loop", 50, "Steps per tf.function call.", "loop", above=0),
    _o("eval_every", 100, "Eval every N steps; 0: at the end only.", "loop",
       minimum=0),
    _o("eval_steps", 0, "Eval batches; 0: the whole eval split.", "loop",
       minimum=0),
    _o("log_every", 50, "Print a progress line every N steps.", "loop",
       above=0),
    _o("jit_compile", False, "XLA-compile the train step: the whole step "
       "with the optimizer update when the run has one replica or one GPU "
       "per process (measured faster on CPU, see docs/benchmarks.md); "
       "forward and backward only otherwise (XLA has no CPU collectives; "
       "not over several logical CPUs in one process).", "loop"),
    _o("check_replicas_every", 0, "Every N steps, check that all replicas "
       "hold identical weights; 0: never.", "loop", minimum=0),
    # output
    _o("checkpoint_every", 100, "Checkpoint every N steps; 0: at the end "
       "only.", "output", minimum=0),
    _o("keep_checkpoints", 3, "Checkpoints kept in model_dir.", "output",
       above=0),
    _o("export", True, "Export a SavedModel at the end.", "output"),
    _o("best_metric", "", "Keep the checkpoint of the best eval of this "
       "metric (e.g. accuracy, loss) in model_dir/best_checkpoint, which "
       "--keep_checkpoints never deletes, and export it to "
       "model_dir/best_export; empty: off.", "output"),
    _enum("best_mode", "auto", ("auto", "min", "max"),
          "Whether --best_metric is best when smallest or largest; auto: "
          "by the metric's name (min for loss, error, mae, mse, perplexity "
          "...; max for accuracy, auc, precision, recall ...), refused for "
          "a name that says neither.", "output"),
    _o("early_stopping_patience", 0, "With --best_metric: stop after this "
       "many evals in a row without a better value; 0: never.", "output",
       minimum=0),
    _o("metrics_file", "", "Append every eval's metrics to this JSON-lines "
       "file as {\"step\": N, \"accuracy\": ...} (what launch.sweep "
       "follows); empty: none.", "output"),
    _o("profile_steps", None, "START,END: profile these steps for "
       "TensorBoard's Profile tab.", "output", "ints", minimum=0),
    # multi_worker
    _enum("all_reduce_alg", "auto", ("auto", "ring", "nccl"),
          "Collective implementation.", "multi_worker"),
    _o("overlap_allreduce", True, "All-reduce the gradients in packs, "
       "last layer first, each as soon as its gradients exist, so the "
       "all-reduce overlaps the backward pass; false: one all-reduce of "
       "every gradient after the backward pass. No effect with "
       "--grad_accum_steps > 1, --jit_compile or PowerSGD's compressed "
       "steps (their gradients all exist only at the end).", "multi_worker"),
    _o("bytes_per_pack", 0, "Bytes per gradient pack with "
       "--overlap_allreduce (the first pack is at most 256 KiB); 0: 4 MiB.",
       "multi_worker", minimum=0),
    _enum("train_feed", "auto", ("auto", "distributed"),
          "How train batches reach the step. auto: a plain tf.data "
          "iterator where a process runs one replica on a CPU (TF's "
          "distributed iterator costs ~60 ms of system CPU per step "
          "there), TF's distributed iterator elsewhere (GPUs: it "
          "prefetches to the device); distributed: always TF's.", "loop"),
    _o("sigterm_grace_seconds", 25.0, "After SIGTERM, exit within this "
       "many seconds even if the peers never answer (a checkpoint being "
       "written is waited for); keep it below the platform's grace "
       "(Kubernetes: 30 s).", "loop", above=0),
    _o("survivor_state", True, "multi_worker_mirrored: after each train "
       "loop call, copy the replicated state (weights, optimizer, step) "
       "into this worker's memory; a worker that loses a peer writes it to "
       "model_dir/survivors/, and the next group resumes there, redoing "
       "no step. Costs one more copy of that state in memory and a copy "
       "per loop call. Not with --shard.", "multi_worker"),
    _o("collective_timeout", 0.0, "Seconds a loop call may run past its "
       "usual length before the task takes a peer as stalled, names its "
       "peers and exits with code 5 (a call longer than this may run to "
       "twice its usual length); TF's own collective timeout, twice this, "
       "covers first calls and collectives outside loop calls. 0: no "
       "timeout.", "multi_worker", minimum=0),
    _enum("allreduce_dtype", "float32", ("float32", "float16", "bfloat16"),
          "All-reduce gradients in this dtype (compression).",
          "multi_worker"),
    _enum("allreduce_compression", "none", ("none", "powersgd"),
          "powersgd: send each big gradient matrix as two rank-R factors "
          "(Vogels et al. 2019, with error feedback and warm start); "
          "vectors and matrices that would not shrink 2x go as they are. "
          "mirrored and multi_worker_mirrored.", "multi_worker"),
    _o("powersgd_rank", 4, "--allreduce_compression=powersgd: the rank R.",
       "multi_worker", above=0),
    _o("powersgd_start_step", 0, "--allreduce_compression=powersgd: plain "
       "all-reduce before this step.", "multi_worker", minimum=0),
    # parameter_server
    _o("ps_shard_min_bytes", 256 << 10, "Split variables into shards of at "
       "least this many bytes; 0: --ps_max_shards fixed shards.",
       "parameter_server", minimum=0),
    _o("ps_max_shards", 0, "Most shards per variable; 0: the number of ps "
       "tasks.", "parameter_server", minimum=0),
    _o("sidecar_timeout", 600.0, "Evaluator task: give up when no new "
       "checkpoint appears for this many seconds.", "parameter_server",
       above=0),
    # model_parallel
    _enum("model_parallel", "none", ("none", "pipeline", "tensor"),
          "Split each replica's model over local devices.", "model_parallel"),
    _o("num_stages", 2, "pipeline: number of stages.", "model_parallel",
       above=0),
    _o("num_microbatches", 1, "pipeline: micro-batches per replica batch "
       "(GPipe).", "model_parallel", above=0),
    _o("tensor_parallel", 2, "tensor: devices each split layer spans.",
       "model_parallel", above=0),
    _o("placement", "", "pipeline: 'pattern=device;...' or a JSON file "
       "{pattern: device}; empty: balanced automatic stages.",
       "model_parallel"),
    # cluster
    _enum("cluster", "env", ("env", "slurm"), "Where the cluster comes "
          "from: TF_CONFIG (env), or Slurm's srun environment (slurm).",
          "cluster"),
    _o("ps_tasks", 0, "--cluster=slurm: the first N tasks are parameter "
       "servers and the next is the chief.", "cluster", minimum=0),
    _o("cluster_port", 0, "--cluster=slurm: first task port on each node; "
       "0: derived from the job id.", "cluster", minimum=0),
)

BY_NAME = {option.name: option for option in OPTIONS}
assert len(BY_NAME) == len(OPTIONS), "an option is defined twice"
