"""Checks that need the strategy or the devices: all in one place.

Flag values alone are checked by tfdist.options when the Config is built;
what depends on the replicas, devices or strategy is checked here, once
the strategy exists and before anything is built or written.
"""

from tfdist import config as config_lib
from tfdist import strategies
from tfdist.errors import ConfigError


def check_batch_size(global_batch_size, num_replicas):
  if global_batch_size % num_replicas:
    raise ConfigError(
        "batch_size (the global batch) must be divisible by the number of "
        f"replicas. Received: batch_size={global_batch_size} for "
        f"{num_replicas} replicas")


def jit_mode(config, info, local_devices):
  """'none', 'step' (whole replica step) or 'forward' (forward/backward
  only); raises where XLA cannot place the replicas."""
  if not config.jit_compile:
    return "none"
  replicas = info.num_replicas // max(info.num_workers, 1)
  on_gpu = bool(local_devices) and "GPU" in local_devices[0].upper()
  # XLA has no CPU collectives: with replicas in other processes the
  # all-reduce must stay outside the compiled step.
  if info.coordinator is None and replicas <= 1 and (
      info.num_replicas <= 1 or on_gpu):
    return "step"
  if info.coordinator is None and replicas > 1 and not on_gpu:
    raise ConfigError(
        "--jit_compile needs one device per process or GPUs: XLA places all "
        "logical CPU devices on CPU:0. Received: jit_compile=True with "
        f"{replicas} local CPU replicas")
  return "forward"


def sharding(config, info):
  """What this process's update shards (tfdist.config.shard_stage): a
  sidecar evaluator trains nothing, so none."""
  if info.reason == "sidecar evaluator":
    return "none"
  return config_lib.shard_stage(config)


def check_run(config, info, local_devices):
  """Every check of the flags against this strategy and these devices."""
  check_batch_size(config.batch_size, info.num_replicas)
  per_replica = config.batch_size // info.num_replicas
  if per_replica % config.grad_accum_steps:
    raise ConfigError(
        "grad_accum_steps must divide the per-replica batch. Received: "
        f"grad_accum_steps={config.grad_accum_steps} for a per-replica "
        f"batch of {per_replica}")
  mode = jit_mode(config, info, local_devices)
  if config.sync_batchnorm and (
      strategies.kind(info.name).runner != "sync" or mode == "forward"):
    raise ConfigError(
        "--sync_batchnorm all-reduces batch statistics inside the forward "
        "pass of synchronous replicas; parameter-server workers train "
        "asynchronously, and --jit_compile with several replicas compiles "
        "the forward pass with XLA, which has no CPU collectives. Received: "
        f"sync_batchnorm=True with strategy={info.name}"
        + (", jit_compile=True" if mode == "forward" else ""))
  if sharding(config, info) != "none" and info.name not in (
      "mirrored", "multi_worker_mirrored"):
    raise ConfigError(
        f"{config_lib.shard_flag(config)} splits the training state over "
        "synchronous replicas: --strategy=mirrored or "
        f"multi_worker_mirrored. Received: strategy={info.name}")
  if info.coordinator and info.num_workers > 1 and config.cache not in (
      "auto", "memory", "off"):
    raise ConfigError(
        "--cache=PATH writes one cache file per input pipeline, and each "
        "parameter-server worker's dataset function cannot tell which "
        "worker it runs on, so they would share one file. Use "
        "--cache=memory or off. Received: "
        f"cache={config.cache} with {info.num_workers} workers")
  if config.check_replicas_every and info.coordinator:
    raise ConfigError(
        "--check_replicas_every compares replicas' copies of the weights; "
        "under parameter_server there is one copy, on the ps tasks. "
        f"Received: check_replicas_every={config.check_replicas_every}")
  if config.allreduce_compression != "none" and (
      strategies.kind(info.name).runner != "sync" or info.name == "tpu"):
    raise ConfigError(
        f"--allreduce_compression={config.allreduce_compression} replaces "
        "the synchronous gradient all-reduce of mirrored and "
        f"multi_worker_mirrored. Received: strategy={info.name}")
  if config.model_parallel == "none":
    return
  if not strategies.kind(info.name).hosts_model_parallel:
    hosting = [n for n, k in strategies.STRATEGIES.items()
               if k.hosts_model_parallel]
    raise ConfigError(
        f"--model_parallel={config.model_parallel} needs a strategy whose "
        f"replica can span local devices: {', '.join(hosting)}. Received: "
        f"strategy={info.name}")
  if config.model_parallel == "tensor" and (
      config.tensor_parallel > len(local_devices)):
    raise ConfigError(
        f"tensor_parallel={config.tensor_parallel} needs that many "
        f"devices; only {len(local_devices)} exist "
        f"({', '.join(local_devices)}). Raise --num_cpu_devices.")
  if config.model_parallel == "pipeline" and (
      per_replica % config.num_microbatches):
    raise ConfigError(
        "num_microbatches must divide the per-replica batch. Received: "
        f"num_microbatches={config.num_microbatches} for a per-replica "
        f"batch of {per_replica}")
