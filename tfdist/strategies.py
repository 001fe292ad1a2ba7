"""Strategy factory: maps a strategy name to a tf.distribute.Strategy, once."""

import dataclasses
from typing import Callable, Tuple

from tfdist import devices
from tfdist import errors
from tfdist import stall_watch
from tfdist.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class StrategyInfo:
  """The strategy plus what the trainer needs to know about this process."""

  strategy: object  # A tf.distribute.Strategy.
  name: str
  reason: str
  is_chief: bool = True
  worker_index: int = 0
  num_workers: int = 1
  task_name: str = "local"
  peers: Tuple[str, ...] = ()
  collective_timeout: float = 0.0  # multi_worker_mirrored: seconds.
  coordinator: object = None  # parameter_server: the ClusterCoordinator.
  partitioner: object = None  # parameter_server: how to shard big tables.

  @property
  def num_replicas(self):
    return self.strategy.num_replicas_in_sync


def configure_cpu_devices(num_devices):
  """Splits the host CPU into `num_devices` logical devices.

  Must run before TensorFlow initializes its runtime.
  """
  if num_devices < 1:
    raise ConfigError("num_cpu_devices must be > 0. "
                      f"Received: num_cpu_devices={num_devices}")
  if num_devices == 1:
    return
  import tensorflow as tf
  cpu = tf.config.list_physical_devices("CPU")[0]
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
  except RuntimeError as e:
    raise ConfigError("num_cpu_devices must be set before TensorFlow starts; "
                      f"{e}") from None


def choose_auto(*, tf_config, num_gpus, num_cpu_devices, num_tpus=0,
                model_parallel="none") -> Tuple[str, str]:
  """Returns (strategy name, reason) for --strategy=auto. Pure."""
  cluster = tf_config.cluster if tf_config else {}
  if cluster.get("ps"):
    return "parameter_server", "TF_CONFIG lists ps tasks"
  trainers = len(cluster.get("chief", [])) + len(cluster.get("worker", []))
  if trainers > 1:
    return ("multi_worker_mirrored",
            f"TF_CONFIG lists {trainers} chief/worker tasks")
  if model_parallel != "none":
    return "default", (f"--model_parallel={model_parallel} spreads one "
                       "replica over the local devices")
  if num_tpus:
    return "tpu", f"{num_tpus} TPU cores are visible"
  if num_gpus > 1:
    return "mirrored", f"{num_gpus} GPUs are visible"
  if num_gpus == 1:
    return "one_device", "one GPU is visible"
  if num_cpu_devices > 1:
    return "mirrored", f"--num_cpu_devices={num_cpu_devices} logical CPUs"
  return "default", "one device and no cluster in TF_CONFIG"


def _mirrored_devices(num_replicas):
  local = devices.local_devices()
  if num_replicas > len(local):
    raise ConfigError(
        f"num_replicas={num_replicas} but only {len(local)} devices exist "
        f"({', '.join(local)}); raise --num_cpu_devices or lower "
        "--num_replicas.")
  return local[:num_replicas] if num_replicas else local


def _tpu_strategy(address):
  import tensorflow as tf
  resolver_cls = tf.distribute.cluster_resolver.TPUClusterResolver
  try:
    resolver = resolver_cls(tpu=address)
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
  except (ValueError, OSError, tf.errors.OpError) as e:
    detail = errors.first_line(e, 200).split(". ")[0]
    raise ConfigError(f"no TPU found at {address!r}: {detail}") from None
  return tf.distribute.TPUStrategy(resolver)


_IMPLEMENTATIONS = {
    "auto": "AUTO", "ring": "RING", "nccl": "NCCL",
}


def cluster_resolver(task):
  """A resolver over the training cluster of a parsed TF_CONFIG.

  Built from our parsed TaskConfig rather than the environment, and without
  the evaluator, which never joins training.
  """
  import tensorflow as tf
  return tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(task.cluster_as_lists()),
      task_type=task.task_type, task_id=task.task_index, rpc_layer="grpc")


def partitioner(config, num_ps):
  """Splits big variables (embeddings) across the ps tasks."""
  import tensorflow as tf
  partitioners = tf.distribute.experimental.partitioners
  max_shards = config.ps_max_shards or num_ps
  if not config.ps_shard_min_bytes:
    return partitioners.FixedShardsPartitioner(num_shards=max_shards)
  return partitioners.MinSizePartitioner(
      min_shard_bytes=config.ps_shard_min_bytes, max_shards=max_shards)


def check_parameter_server_task(task):
  """The task (a parsed TF_CONFIG, or None) that builds
  ParameterServerStrategy: the chief of a cluster with ps tasks. No TF
  here: tfdist.api checks this before TF's import."""
  if task is None or not task.cluster.get("ps"):
    raise ConfigError(
        "--strategy=parameter_server needs a TF_CONFIG with chief, worker "
        "and ps tasks; start it with python -m launch.local --chief "
        "--workers=2 --ps=1 -- ...")
  if task.task_type != "chief":
    raise ConfigError(f"only the chief builds ParameterServerStrategy. "
                      f"Received: task type {task.task_type!r}")


def _parameter_server(config, task):
  check_parameter_server_task(task)
  import tensorflow as tf
  # No variable_partitioner: Keras 3 variables cannot wrap ShardedVariable.
  # Models that can shard take the partitioner and make one variable per
  # shard, which the strategy places round-robin over the ps tasks.
  strategy = tf.distribute.ParameterServerStrategy(cluster_resolver(task))
  return strategy, {
      "coordinator": tf.distribute.coordinator.ClusterCoordinator(strategy),
      "partitioner": partitioner(config, len(task.cluster["ps"]))}


def _multi_worker(config, task):
  if task is not None and task.task_type not in ("chief", "worker"):
    raise ConfigError(f"--strategy=multi_worker_mirrored runs chief and "
                      f"worker tasks. Received: task type {task.task_type!r}")
  import tensorflow as tf
  implementation = getattr(tf.distribute.experimental.CommunicationImplementation,
                           _IMPLEMENTATIONS[config.all_reduce_alg])
  options = tf.distribute.experimental.CommunicationOptions(
      # The stall watch names a stalled peer first (tfdist/stall_watch.py).
      timeout_seconds=stall_watch.tf_backstop_seconds(
          config.collective_timeout),
      implementation=implementation)
  resolver = cluster_resolver(task) if task else None
  return tf.distribute.MultiWorkerMirroredStrategy(
      cluster_resolver=resolver, communication_options=options), {}


def _default(config, task):
  del config, task
  import tensorflow as tf
  return tf.distribute.get_strategy(), {}


def _one_device(config, task):
  del config, task
  import tensorflow as tf
  return tf.distribute.OneDeviceStrategy(devices.local_devices()[0]), {}


def _mirrored(config, task):
  del task
  import tensorflow as tf
  if config.shard_optimizer or config.shard != "none":
    # The sharded update's collectives need TF's collective all-reduce.
    from tfdist import collectives  # pylint: disable=g-import-not-at-top
    return collectives.mirrored_with_collectives(
        _mirrored_devices(config.num_replicas)), {}
  return tf.distribute.MirroredStrategy(
      _mirrored_devices(config.num_replicas)), {}


def _tpu(config, task):
  del task
  return _tpu_strategy(config.tpu), {}


@dataclasses.dataclass(frozen=True)
class StrategyKind:
  """What tfdist knows about one --strategy name."""

  factory: Callable  # (config, tf_config) -> (strategy, extra StrategyInfo)
  runner: str  # "sync" or "parameter_server": see tfdist.runners.
  hosts_model_parallel: bool  # One replica may span several local devices.
  preemptible: bool  # SIGTERM saves and exits 42 (tfdist.preemption); TPU is untested.


# The one table of strategies. TensorFlow is imported inside the factories,
# so that flags are checked against these names before TensorFlow starts.
STRATEGIES = {
    "default": StrategyKind(_default, "sync", True, True),
    "one_device": StrategyKind(_one_device, "sync", True, True),
    "mirrored": StrategyKind(_mirrored, "sync", False, True),
    "multi_worker_mirrored": StrategyKind(_multi_worker, "sync", True, True),
    "parameter_server": StrategyKind(_parameter_server, "parameter_server",
                                     False, False),
    "tpu": StrategyKind(_tpu, "sync", False, False),
}
NAMES = tuple(STRATEGIES)


def kind(name) -> StrategyKind:
  if name not in STRATEGIES:
    raise ConfigError(f"Unrecognized strategy: {name!r}. "
                      f"Valid: {', '.join(NAMES)}.")
  return STRATEGIES[name]


def create_strategy(config, *, tf_config=None) -> StrategyInfo:
  """Builds the strategy named by `config.strategy` (resolving `auto`).

  `tf_config` is a parsed `tfdist.cluster.TaskConfig`, or None.
  """
  import tensorflow as tf
  name, reason = config.strategy, "requested with --strategy"
  if name == "auto":
    name, reason = choose_auto(
        tf_config=tf_config,
        num_gpus=len(tf.config.list_physical_devices("GPU")),
        num_cpu_devices=config.num_cpu_devices,
        model_parallel=config.model_parallel)
  strategy, extra = kind(name).factory(config, tf_config)
  if name == "parameter_server":
    return StrategyInfo(
        strategy=strategy, name=name, reason=reason,
        num_workers=len(tf_config.cluster.get("worker", {})),
        task_name="chief:0", **extra)
  multi_worker = name == "multi_worker_mirrored" and tf_config is not None
  return StrategyInfo(
      strategy=strategy, name=name, reason=reason,
      is_chief=tf_config.is_chief if multi_worker else True,
      worker_index=_trainer_index(tf_config) if multi_worker else 0,
      num_workers=tf_config.num_trainers if multi_worker else 1,
      task_name=(f"{tf_config.task_type}:{tf_config.task_index}"
                 if multi_worker else "local"),
      peers=_peers(tf_config) if multi_worker else (),
      collective_timeout=config.collective_timeout if multi_worker else 0.0)


def _peers(task):
  return tuple(f"{role}:{index} ({address})"
               for role, tasks in task.training_cluster.items()
               for index, address in sorted(tasks.items())
               if (role, index) != (task.task_type, task.task_index))


def _trainer_index(task):
  """Chief first, then workers: the order MWMS numbers them."""
  if task.task_type == "chief":
    return 0
  return task.task_index + len(task.cluster.get("chief", {}))
