"""TF_CONFIG as pure functions: build, parse, validate. No TensorFlow import.

Only `tf_config_from_env` reads the environment, and nothing here writes it:
launchers pass each task's TF_CONFIG to the processes they start.
"""

import dataclasses
import json
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

from tfdist.errors import TfdistError

ROLES = ("chief", "worker", "ps", "evaluator")
TRAINING_ROLES = ("chief", "worker", "ps")

Addresses = Union[Sequence[str], Mapping[int, str]]


class ClusterError(TfdistError, ValueError):
  """An invalid cluster description or TF_CONFIG."""


def check_address(address, *, where="address"):
  """Returns (host, port) of 'host:port', or raises naming the problem."""
  if not isinstance(address, str) or ":" not in address:
    raise ClusterError(f"{where} must be host:port. Received: {address!r}")
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
    raise ClusterError(f"{where} needs a port in 1..65535. "
                       f"Received: {address!r}")
  return host.strip("[]"), int(port)


def _as_index_map(role, addresses) -> Dict[int, str]:
  """Lists and Kubeflow's sparse {"1": "h:p"} dicts, as {index: address}."""
  if isinstance(addresses, Mapping):
    try:
      return {int(k): v for k, v in addresses.items()}
    except ValueError:
      raise ClusterError(f"cluster[{role!r}] keys must be task indices. "
                         f"Received: {sorted(addresses)}") from None
  if isinstance(addresses, (list, tuple)):
    return dict(enumerate(addresses))
  raise ClusterError(f"cluster[{role!r}] must be a list of host:port. "
                     f"Received: {addresses!r}")


def validate_cluster(cluster: Mapping[str, Addresses]) -> Dict[str, Dict[int, str]]:
  """Checks roles, addresses and duplicates; returns {role: {index: addr}}."""
  if not isinstance(cluster, Mapping) or not cluster:
    raise ClusterError(f"cluster must be a non-empty object. "
                       f"Received: {cluster!r}")
  normalized, seen = {}, {}
  for role, addresses in cluster.items():
    if role not in ROLES:
      raise ClusterError(f"Unrecognized task type in cluster: {role!r}. "
                         f"Valid: {', '.join(ROLES)}.")
    tasks = _as_index_map(role, addresses)
    for index, address in tasks.items():
      where = f"{role}:{index}"
      check_address(address, where=f"cluster {where}")
      if address in seen:
        raise ClusterError(f"duplicate address {address} for {seen[address]} "
                           f"and {where}")
      seen[address] = where
    if tasks:
      normalized[role] = tasks
  if normalized.get("ps") and not normalized.get("chief"):
    raise ClusterError("a cluster with ps tasks needs a chief (the "
                       "coordinator). Add --chief=host:port.")
  if len(normalized.get("chief", {})) > 1:
    raise ClusterError("a cluster has at most one chief. Received: "
                       f"{len(normalized['chief'])}")
  return normalized


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """A parsed, validated TF_CONFIG."""

  cluster: Dict[str, Dict[int, str]]
  task_type: str
  task_index: int
  environment: Optional[str] = None

  @property
  def training_cluster(self) -> Dict[str, Dict[int, str]]:
    """The cluster without the evaluator, which never joins training."""
    return {role: tasks for role, tasks in self.cluster.items()
            if role in TRAINING_ROLES}

  @property
  def num_trainers(self):
    return sum(len(self.cluster.get(role, {})) for role in ("chief",
                                                            "worker"))

  @property
  def is_chief(self):
    """The chief, or worker 0 when there is no chief (MWMS convention)."""
    if self.task_type == "chief":
      return True
    return (self.task_type == "worker" and self.task_index == 0 and
            "chief" not in self.cluster)

  @property
  def address(self):
    return self.cluster[self.task_type][self.task_index]

  def cluster_as_lists(self, *, training_only=True):
    """{role: [addresses]} when dense, {role: {index: addr}} when sparse."""
    cluster = self.training_cluster if training_only else self.cluster
    return {role: _dense_or_sparse(tasks) for role, tasks in cluster.items()}


def _dense_or_sparse(tasks):
  if sorted(tasks) == list(range(len(tasks))):
    return [tasks[i] for i in range(len(tasks))]
  return {str(i): a for i, a in sorted(tasks.items())}


def parse_tf_config(raw: Union[str, Mapping]) -> TaskConfig:
  """Parses TF_CONFIG (JSON text or a dict) and validates it."""
  if isinstance(raw, str):
    try:
      raw = json.loads(raw)
    except json.JSONDecodeError as e:
      raise ClusterError(f"TF_CONFIG is not valid JSON: {e}") from None
  if not isinstance(raw, Mapping):
    raise ClusterError(f"TF_CONFIG must be a JSON object. Received: {raw!r}")
  cluster = validate_cluster(raw.get("cluster") or {})
  task = raw.get("task")
  if not isinstance(task, Mapping) or "type" not in task:
    raise ClusterError("TF_CONFIG has no task: add "
                       '"task": {"type": ..., "index": ...}')
  task_type, index = task["type"], task.get("index", 0)
  if task_type not in ROLES:
    raise ClusterError(f"Unrecognized task type: {task_type!r}. "
                       f"Valid: {', '.join(ROLES)}.")
  if not isinstance(index, int) or index not in cluster.get(task_type, {}):
    known = sorted(cluster.get(task_type, {}))
    raise ClusterError(f"task index {index!r} of {task_type!r} is not in the "
                       f"cluster (its indices: {known})")
  return TaskConfig(cluster=cluster, task_type=task_type, task_index=index,
                    environment=raw.get("environment"))


def tf_config_from_env(environ: Mapping[str, str]) -> Optional[TaskConfig]:
  """The one reader of TF_CONFIG; pass `os.environ`."""
  raw = environ.get("TF_CONFIG", "").strip()
  return parse_tf_config(raw) if raw else None


def addresses_from_hosts(hosts: Sequence[str], base_port: int,
                         ) -> Tuple[str, ...]:
  """'h1,h2' with base port P: tasks on one host take P, P+1, ..."""
  used: Dict[str, int] = {}
  result = []
  for host in hosts:
    port = base_port + used.get(host, 0)
    used[host] = used.get(host, 0) + 1
    address = f"{host}:{port}"
    check_address(address)
    result.append(address)
  return tuple(result)


def build_tf_configs(cluster: Mapping[str, Sequence[str]]
                     ) -> Dict[Tuple[str, int], dict]:
  """TF_CONFIG for every task of a cluster, keyed by (role, index).

  The evaluator's TF_CONFIG holds only itself (tensorflow/tensorflow#46169:
  an evaluator must not join an MWMS cluster), except in a PS job: there
  it also lists the training cluster, whose ps count says how the trainer
  split big variables. tfdist's evaluator never connects to any of them.
  """
  normalized = validate_cluster(
      {role: list(addrs) for role, addrs in cluster.items() if addrs})
  training = {role: [tasks[i] for i in sorted(tasks)]
              for role, tasks in normalized.items()
              if role in TRAINING_ROLES}
  configs = {}
  for role, tasks in normalized.items():
    for index, address in sorted(tasks.items()):
      own = training
      if role == "evaluator":
        own = {"evaluator": [address],
               **(training if "ps" in training else {})}
      configs[(role, index)] = {
          "cluster": own,
          "task": {"type": role, "index": 0 if role == "evaluator" else index},
      }
  return configs


def to_env_lines(configs: Mapping[Tuple[str, int], dict]):
  """`export TF_CONFIG='...'` lines, one per task, with a comment each."""
  lines = []
  for (role, index), config in configs.items():
    lines.append(f"# {role}:{index}")
    lines.append("export TF_CONFIG='" + json.dumps(config, sort_keys=True,
                                                   separators=(",", ":")) + "'")
  return lines


def expand_hostlist(hostlist: str) -> Tuple[str, ...]:
  """Slurm's compressed host lists: 'n[01-03,7],gpu5' -> n01 n02 n03 n7 gpu5."""
  hosts, depth, part = [], 0, ""
  for char in hostlist + ",":
    if char == "," and depth == 0:
      if part:
        hosts.extend(_expand_one(part))
      part = ""
      continue
    depth += {"[": 1, "]": -1}.get(char, 0)
    part += char
  return tuple(hosts)


def _expand_one(part):
  if "[" not in part:
    return [part]
  prefix, _, rest = part.partition("[")
  ranges, _, suffix = rest.partition("]")
  names = []
  for item in ranges.split(","):
    start, _, end = item.partition("-")
    for number in range(int(start), int(end or start) + 1):
      names.append(f"{prefix}{number:0{len(start)}d}")
  return [name + tail for name in names for tail in _expand_one(suffix)]


def _tasks_per_node(spec: str) -> Tuple[int, ...]:
  """SLURM_STEP_TASKS_PER_NODE: '2(x3),1' -> 2, 2, 2, 1."""
  counts = []
  for item in spec.split(","):
    count, _, repeat = item.partition("(x")
    counts.extend([int(count)] * int(repeat.rstrip(")") or 1))
  return tuple(counts)


def tf_config_from_slurm(environ: Mapping[str, str], *, ps_tasks: int = 0,
                         base_port: int = 0) -> TaskConfig:
  """TF_CONFIG for this srun task, from Slurm's environment. Pure.

  The first `ps_tasks` tasks are parameter servers; with ps tasks, the next
  is the chief; the rest are workers. Task ports are base_port + the task's
  local id on its node; base_port 0 derives one from the job id, so
  concurrent jobs on a node do not collide.
  """
  if "SLURM_STEP_NODELIST" not in environ:
    raise ClusterError("--cluster=slurm must run under srun: "
                       "SLURM_STEP_NODELIST is unset (the batch script "
                       "itself is not a task; use launch/slurm.sbatch).")
  nodes = expand_hostlist(environ["SLURM_STEP_NODELIST"])
  per_node = _tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])
  num_tasks, rank = int(environ["SLURM_STEP_NUM_TASKS"]), int(
      environ["SLURM_PROCID"])
  if not 0 <= ps_tasks < num_tasks:
    raise ClusterError(f"ps_tasks must leave at least one trainer. Received: "
                       f"ps_tasks={ps_tasks} for {num_tasks} tasks")
  if not base_port:
    base_port = 20000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000
  addresses = [f"{node}:{base_port + local}"
               for node, count in zip(nodes, per_node)
               for local in range(count)]
  roles = (["ps"] * ps_tasks + (["chief"] if ps_tasks else [])
           + ["worker"] * num_tasks)[:num_tasks]
  cluster: Dict[str, list] = {}
  for role, address in zip(roles, addresses):
    cluster.setdefault(role, []).append(address)
  role = roles[rank]
  index = roles[:rank].count(role)
  return parse_tf_config({"cluster": cluster,
                          "task": {"type": role, "index": index}})
