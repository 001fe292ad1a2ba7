"""The frozen, validated run configuration. No TensorFlow import here."""

import dataclasses
from typing import Optional, Tuple

from tfdist.errors import ConfigError

STRATEGIES = ("auto", "default", "one_device", "mirrored",
              "multi_worker_mirrored", "parameter_server", "tpu")
MIXED_PRECISION = ("none", "mixed_float16", "mixed_bfloat16")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "rmsprop")
ALL_REDUCE_ALGS = ("auto", "ring", "nccl")
ALLREDUCE_DTYPES = ("float32", "float16", "bfloat16")
MODEL_PARALLEL = ("none", "pipeline", "tensor")


def _require(ok, message):
  if not ok:
    raise ConfigError(message)


def _choice(name, value, valid):
  _require(value in valid, f"Unrecognized {name}: {value!r}. "
           f"Valid: {', '.join(valid)}.")


def _positive(name, value):
  _require(value > 0, f"{name} must be > 0. Received: {name}={value}")


def _non_negative(name, value):
  _require(value >= 0, f"{name} must be >= 0. Received: {name}={value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Everything a run needs; built once by the entry module."""

  model_dir: str
  strategy: str = "auto"
  model: str = "mlp"
  dataset: str = "digits"
  data_dir: str = "~/tensorflow_datasets"
  batch_size: int = 64
  train_steps: int = 300
  optimizer: str = "adam"
  learning_rate: float = 1e-3
  eval_every: int = 100
  eval_steps: int = 0
  checkpoint_every: int = 100
  keep_checkpoints: int = 3
  steps_per_loop: int = 50
  log_every: int = 50
  num_cpu_devices: int = 1
  num_replicas: int = 0
  mixed_precision: str = "none"
  seed: int = 42
  tpu: str = "local"
  profile_steps: Optional[Tuple[int, int]] = None
  synthetic_shape: Tuple[int, ...] = (8, 8, 1)
  synthetic_classes: int = 10
  export: bool = True
  jit_compile: bool = False
  all_reduce_alg: str = "auto"
  bytes_per_pack: int = 0
  collective_timeout: float = 0.0
  allreduce_dtype: str = "float32"
  check_replicas_every: int = 0
  ps_shard_min_bytes: int = 256 << 10
  ps_max_shards: int = 0
  sidecar_timeout: float = 600.0
  model_parallel: str = "none"
  num_stages: int = 2
  tensor_parallel: int = 2
  num_microbatches: int = 1
  placement: str = ""

  def __post_init__(self):
    _require(bool(self.model_dir), "--model_dir is required.")
    _choice("strategy", self.strategy, STRATEGIES)
    _choice("optimizer", self.optimizer, OPTIMIZERS)
    _choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
    _choice("all_reduce_alg", self.all_reduce_alg, ALL_REDUCE_ALGS)
    _choice("allreduce_dtype", self.allreduce_dtype, ALLREDUCE_DTYPES)
    _choice("model_parallel", self.model_parallel, MODEL_PARALLEL)
    for name in ("batch_size", "train_steps", "steps_per_loop", "log_every",
                 "num_cpu_devices", "keep_checkpoints", "synthetic_classes",
                 "num_stages", "tensor_parallel", "num_microbatches"):
      _positive(name, getattr(self, name))
    for name in ("eval_every", "eval_steps", "checkpoint_every",
                 "num_replicas", "bytes_per_pack", "collective_timeout",
                 "check_replicas_every", "ps_shard_min_bytes",
                 "ps_max_shards"):
      _non_negative(name, getattr(self, name))
    _positive("learning_rate", self.learning_rate)
    _positive("sidecar_timeout", self.sidecar_timeout)
    _require(all(d > 0 for d in self.synthetic_shape),
             f"synthetic_shape dims must be > 0. Received: "
             f"synthetic_shape={self.synthetic_shape}")
    if self.profile_steps is not None:
      start, end = self.profile_steps
      _require(0 <= start < end,
               "profile_steps must be START,END with 0 <= START < END. "
               f"Received: profile_steps={start},{end}")

  def to_dict(self):
    return dataclasses.asdict(self)
