"""The one cluster description every launcher takes: roles and counts.

Launchers turn it into addresses their own way (free local ports, pod
hostnames, Slurm nodes, SSH hosts); TF_CONFIG always comes from
tfdist.cluster.build_tf_configs.
"""

import dataclasses
import json
import sys
from typing import Dict, List, Mapping, Sequence

from tfdist import cluster


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterDescription:
  workers: int
  chief: bool = False
  ps: int = 0
  evaluator: bool = False

  def __post_init__(self):
    if self.workers < 0 or self.ps < 0:
      raise ValueError(f"task counts must be >= 0. Received: "
                       f"workers={self.workers}, ps={self.ps}")
    if self.workers + int(self.chief) < 1:
      raise ValueError("a job needs at least one worker or a chief. "
                       f"Received: workers={self.workers}, chief={self.chief}")
    if self.ps and not self.chief:
      raise ValueError(f"ps tasks need a chief (the coordinator). Received: "
                       f"ps={self.ps} without --chief")

  def counts(self) -> Dict[str, int]:
    counts = {"chief": int(self.chief), "worker": self.workers,
              "ps": self.ps, "evaluator": int(self.evaluator)}
    return {role: n for role, n in counts.items() if n}


def add_arguments(parser, *, workers_default=1):
  """The cluster description flags every launcher takes."""
  parser.add_argument("--workers", type=int, default=workers_default,
                      help="Number of worker tasks.")
  parser.add_argument("--chief", action="store_true",
                      help="Add a chief task (required with --ps).")
  parser.add_argument("--ps", type=int, default=0,
                      help="Number of parameter-server tasks.")
  parser.add_argument("--evaluator", action="store_true",
                      help="Add a sidecar evaluator, outside the training "
                      "cluster.")


def from_args(args) -> ClusterDescription:
  return ClusterDescription(workers=args.workers, chief=args.chief,
                            ps=args.ps, evaluator=args.evaluator)


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
