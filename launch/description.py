"""The one cluster description every launcher takes: roles and counts.

Launchers turn it into addresses their own way (free local ports, pod
hostnames, Slurm nodes, SSH hosts); TF_CONFIG always comes from
tfdist.cluster.build_tf_configs.
"""

import dataclasses
import json
import sys
from typing import Dict, List, Mapping, Optional, Sequence

from tfdist import cluster


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterDescription:
  """Roles and counts. `min_workers` and `max_workers` (--workers=MIN:MAX)
  make the job elastic: `workers` is then the current count, which the
  launcher changes between MIN and MAX."""

  workers: int
  chief: bool = False
  ps: int = 0
  evaluator: bool = False
  min_workers: Optional[int] = None
  max_workers: Optional[int] = None
  # A tf.data service beside the job: a dispatcher and this many data
  # workers (not in TF_CONFIG: the trainers get --data_service).
  data_workers: int = 0

  def __post_init__(self):
    if self.workers < 0 or self.ps < 0:
      raise ValueError(f"task counts must be >= 0. Received: "
                       f"workers={self.workers}, ps={self.ps}")
    if self.data_workers < 0:
      raise ValueError(f"--data_workers must be >= 0. Received: "
                       f"--data_workers={self.data_workers}")
    if self.elastic and not (
        1 <= self.min_workers <= self.workers <= self.max_workers):
      raise ValueError(f"--workers=MIN:MAX needs 1 <= MIN <= MAX. Received: "
                       f"workers={self.min_workers}:{self.max_workers}")
    if self.workers + int(self.chief) < 1:
      raise ValueError("a job needs at least one worker or a chief. "
                       f"Received: workers={self.workers}, chief={self.chief}")
    if self.ps and not self.chief:
      raise ValueError(f"ps tasks need a chief (the coordinator). Received: "
                       f"ps={self.ps} without --chief")

  @property
  def elastic(self):
    return self.min_workers is not None

  def counts(self) -> Dict[str, int]:
    counts = {"chief": int(self.chief), "worker": self.workers,
              "ps": self.ps, "evaluator": int(self.evaluator)}
    return {role: n for role, n in counts.items() if n}


def worker_count(text):
  """--workers: N, or MIN:MAX for an elastic job (a (MIN, MAX) pair)."""
  low, colon, high = text.partition(":")
  try:
    return (int(low), int(high)) if colon else int(low)
  except ValueError:
    raise ValueError(f"--workers takes N or MIN:MAX. Received: "
                     f"{text!r}") from None


def add_arguments(parser, *, workers_default=1, elastic=False):
  """The cluster description flags every launcher takes; `elastic`: the
  launcher accepts --workers=MIN:MAX."""
  parser.add_argument(
      "--workers", type=worker_count if elastic else int,
      default=workers_default,
      help="Number of worker tasks" + (
          ", or MIN:MAX: an elastic job that drops lost workers down to "
          "MIN and grows to MAX when --host_discovery offers slots."
          if elastic else "."))
  parser.add_argument("--chief", action="store_true",
                      help="Add a chief task (required with --ps).")
  parser.add_argument("--ps", type=int, default=0,
                      help="Number of parameter-server tasks.")
  parser.add_argument("--evaluator", action="store_true",
                      help="Add a sidecar evaluator, outside the training "
                      "cluster.")


def add_data_workers_argument(parser):
  """--data_workers, for a launcher that starts a tf.data service."""
  parser.add_argument("--data_workers", type=int, default=0,
                      help="Start a tf.data service beside the job: a "
                      "dispatcher (fault-tolerant, with a work_dir) and "
                      "this many data workers; the trainers get "
                      "--data_service. 0: none (default).")


def from_args(args) -> ClusterDescription:
  service = {"data_workers": getattr(args, "data_workers", 0)}
  if isinstance(args.workers, tuple):
    low, high = args.workers
    return ClusterDescription(workers=high, min_workers=low,
                              max_workers=high, chief=args.chief,
                              ps=args.ps, evaluator=args.evaluator,
                              **service)
  return ClusterDescription(workers=args.workers, chief=args.chief,
                            ps=args.ps, evaluator=args.evaluator, **service)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  role: str
  index: int
  address: str
  argv: List[str]
  env: Dict[str, str]

  @property
  def name(self):
    return f"{self.role}:{self.index}"


def task_commands(description: ClusterDescription, *,
                  addresses: Mapping[str, Sequence[str]], module: str,
                  train_args: Sequence[str]) -> List[TaskSpec]:
  """The command and TF_CONFIG of every task, chief first."""
  if {r: len(a) for r, a in addresses.items()} != description.counts():
    raise ValueError(f"addresses {dict(addresses)} do not match the "
                     f"description {description.counts()}")
  configs = cluster.build_tf_configs(addresses)
  argv = [sys.executable, "-m", module, *train_args]
  return [TaskSpec(role=role, index=index,
                   address=addresses[role][index], argv=list(argv),
                   env=task_env(description, config))
          for (role, index), config in configs.items()]


def role_env(description: ClusterDescription) -> Dict[str, str]:
  """Environment every task of the job needs, TF_CONFIG aside."""
  if description.ps:
    # TF's PS guide: fail RPCs to a lost worker fast so the coordinator
    # re-dispatches its closures instead of waiting.
    return {"GRPC_FAIL_FAST": "use_caller"}
  return {}


def task_env(description: ClusterDescription, tf_config: dict):
  """The environment a task needs besides the launcher's own."""
  return {"TF_CONFIG": json.dumps(tf_config), **role_env(description)}


def restarts_alone(description: ClusterDescription, role: str) -> bool:
  """In a PS job a failed worker is restarted on its own: the coordinator
  re-dispatches its steps. Any other failure restarts the whole job."""
  return bool(description.ps) and role == "worker"
