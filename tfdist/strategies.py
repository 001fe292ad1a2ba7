"""Strategy factory: maps a strategy name to a tf.distribute.Strategy, once."""

import dataclasses
from typing import Tuple

import tensorflow as tf

from tfdist.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class StrategyInfo:
  """The strategy plus what the trainer needs to know about this process."""

  strategy: tf.distribute.Strategy
  name: str
  reason: str
  is_chief: bool = True
  worker_index: int = 0
  num_workers: int = 1
  task_name: str = "local"
  peers: Tuple[str, ...] = ()
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


def _local_devices():
  gpus = tf.config.list_logical_devices("GPU")
  return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def _mirrored_devices(num_replicas):
  devices = _local_devices()
  if num_replicas > len(devices):
    raise ConfigError(
        f"num_replicas={num_replicas} but only {len(devices)} devices exist "
        f"({', '.join(devices)}); raise --num_cpu_devices or lower "
        "--num_replicas.")
  return devices[:num_replicas] if num_replicas else devices


def _tpu_strategy(address):
  resolver_cls = tf.distribute.cluster_resolver.TPUClusterResolver
  try:
    resolver = resolver_cls(tpu=address)
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
  except (ValueError, OSError, tf.errors.OpError) as e:
    detail = (str(e).splitlines() or [type(e).__name__])[0].split(". ")[0]
    raise ConfigError(f"no TPU found at {address!r}: {detail[:200]}") from None
  return tf.distribute.TPUStrategy(resolver)


_IMPLEMENTATIONS = {
    "auto": "AUTO", "ring": "RING", "nccl": "NCCL",
}


def cluster_resolver(task):
  """A resolver over the training cluster of a parsed TF_CONFIG.

  Built from our parsed TaskConfig rather than the environment, and without
  the evaluator, which never joins training.
  """
  return tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(task.cluster_as_lists()),
      task_type=task.task_type, task_id=task.task_index, rpc_layer="grpc")


def _partitioner(config, num_ps):
  """Splits big variables (embeddings) across the ps tasks."""
  partitioners = tf.distribute.experimental.partitioners
  max_shards = config.ps_max_shards or num_ps
  if not config.ps_shard_min_bytes:
    return partitioners.FixedShardsPartitioner(num_shards=max_shards)
  return partitioners.MinSizePartitioner(
      min_shard_bytes=config.ps_shard_min_bytes, max_shards=max_shards)


def _parameter_server(config, task):
  if task is None or not task.cluster.get("ps"):
    raise ConfigError(
        "--strategy=parameter_server needs a TF_CONFIG with chief, worker "
        "and ps tasks; start it with python -m launch.local --chief "
        "--workers=2 --ps=1 -- ...")
  if task.task_type != "chief":
    raise ConfigError(f"only the chief builds ParameterServerStrategy. "
                      f"Received: task type {task.task_type!r}")
  # No variable_partitioner: Keras 3 variables cannot wrap ShardedVariable.
  # Models that can shard take the partitioner and make one variable per
  # shard, which the strategy places round-robin over the ps tasks.
  strategy = tf.distribute.ParameterServerStrategy(cluster_resolver(task))
  return (strategy, tf.distribute.coordinator.ClusterCoordinator(strategy),
          _partitioner(config, len(task.cluster["ps"])))


def _multi_worker(config, task):
  if task is not None and task.task_type not in ("chief", "worker"):
    raise ConfigError(f"--strategy=multi_worker_mirrored runs chief and "
                      f"worker tasks. Received: task type {task.task_type!r}")
  implementation = getattr(tf.distribute.experimental.CommunicationImplementation,
                           _IMPLEMENTATIONS[config.all_reduce_alg])
  options = tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=config.bytes_per_pack,
      timeout_seconds=config.collective_timeout or None,
      implementation=implementation)
  resolver = cluster_resolver(task) if task else None
  return tf.distribute.MultiWorkerMirroredStrategy(
      cluster_resolver=resolver, communication_options=options)


def create_strategy(config, *, tf_config=None) -> StrategyInfo:
  """Builds the strategy named by `config.strategy` (resolving `auto`).

  `tf_config` is a parsed `tfdist.cluster.TaskConfig`, or None.
  """
  name, reason = config.strategy, "requested with --strategy"
  coordinator = partitioner = None
  if name == "auto":
    name, reason = choose_auto(
        tf_config=tf_config,
        num_gpus=len(tf.config.list_physical_devices("GPU")),
        num_cpu_devices=config.num_cpu_devices,
        model_parallel=config.model_parallel)
  if name == "default":
    strategy = tf.distribute.get_strategy()
  elif name == "one_device":
    strategy = tf.distribute.OneDeviceStrategy(_local_devices()[0])
  elif name == "mirrored":
    strategy = tf.distribute.MirroredStrategy(
        _mirrored_devices(config.num_replicas))
  elif name == "tpu":
    strategy = _tpu_strategy(config.tpu)
  elif name == "multi_worker_mirrored":
    strategy = _multi_worker(config, tf_config)
  elif name == "parameter_server":
    strategy, coordinator, partitioner = _parameter_server(config, tf_config)
  else:
    raise ConfigError(f"Unrecognized strategy: {name!r}")
  multi_worker = name == "multi_worker_mirrored" and tf_config is not None
  if name == "parameter_server":
    return StrategyInfo(
        strategy=strategy, name=name, reason=reason, coordinator=coordinator,
        partitioner=partitioner,
        num_workers=len(tf_config.cluster.get("worker", {})),
        task_name="chief:0")
  return StrategyInfo(
      strategy=strategy, name=name, reason=reason,
      is_chief=tf_config.is_chief if multi_worker else True,
      worker_index=_trainer_index(tf_config) if multi_worker else 0,
      num_workers=tf_config.num_trainers if multi_worker else 1,
      task_name=(f"{tf_config.task_type}:{tf_config.task_index}"
                 if multi_worker else "local"),
      peers=_peers(tf_config) if multi_worker else ())


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
