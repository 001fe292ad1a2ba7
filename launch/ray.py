"""Ray launcher: every task of a tfdist job in a Ray actor.

python -m launch.ray [--address=auto] --workers=2 [--chief] [--ps=N]
    [--evaluator] [--cpus_per_task=1] [--gpus_per_task=0]
    [--placement_strategy=SPREAD|PACK] [--max_restarts=K]
    [--data_workers=K] -- <tfdist.train flags>
python -m launch.ray --address=auto --workers=MIN:MAX ... -- <flags>

One placement group holds a bundle per task. In each bundle a small actor
reports its node's IP and a free port; tfdist.cluster builds every task's
TF_CONFIG from them (not Ray Train's TensorflowConfig, which knows no ps
or chief), and each actor runs the unchanged `python -m tfdist.train` as a
subprocess, whose output comes back prefixed with `role:index |`. The
restart policy is launch.core's, the same as launch.local's.

Elastic (--workers=MIN:MAX): every --discovery_seconds the launcher counts
the worker slots of the cluster's live nodes (each node's CPUs, and GPUs,
over --cpus_per_task and --gpus_per_task, less the other tasks). A node
that joins grows the group, up to MAX; a node that leaves takes its
workers with it, and the group goes on without them while MIN remain;
a node that lost a worker for good is not counted again (Horovod's
elastic blacklist does the same with hosts). Each change reserves a new
placement group and restarts the group from the checkpoint.

Warm spares (--spares, auto: one per task when the job can restart): a
spare (launch.spare) waits in an actor of its own on each node the tasks
run on, and a restart, preemption resume or membership change hands the
node's tasks to them (launch.ray_spares).

A tf.data service (--data_workers=K): the dispatcher and each data worker
run in an actor of their own (num_cpus=0, outside the placement group, so
they outlive a membership change), restarted when they end; a data worker
advertises its node's IP on the route to the dispatcher, and the trainers
get --data_service.

No task outlives the launcher: a task process gets SIGKILL when its
actor's process dies (PR_SET_PDEATHSIG, set from a thread that lives as
long as the actor, since Ray runs actor methods in threads), actors are
owned by this driver, and a Ray started here is shut down at the end.

Needs the `ray` extra: pip install -e '.[cpu,ray]'.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from . import arguments
from . import core
from . import data_service
from . import description
from . import processes
from . import ray_session
from . import spare

try:
  import ray as ray_module
  from . import ray_actor
  from . import ray_spares
except ImportError:  # The `ray` extra is not installed; main() says so.
  ray_module = ray_actor = ray_spares = None

_STRATEGIES = ("SPREAD", "PACK")


def parse_args(argv):
  parser = argparse.ArgumentParser(
      prog="python -m launch.ray",
      description="Run a tfdist job as Ray actors, one per task.")
  description.add_arguments(parser, elastic=True)
  parser.add_argument("--discovery_seconds", type=float, default=5.0,
                      help="With --workers=MIN:MAX: how often to count the "
                      "worker slots of the cluster's live nodes.")
  parser.add_argument("--address", default=None,
                      help="Ray cluster to join ('auto', or host:port); by "
                      "default a local Ray is started and shut down.")
  parser.add_argument("--cpus_per_task", type=float, default=1.0,
                      help="CPUs reserved for each task (default 1).")
  parser.add_argument("--gpus_per_task", type=float, default=0.0,
                      help="GPUs reserved for each task (default 0).")
  parser.add_argument("--placement_strategy", default="SPREAD",
                      choices=_STRATEGIES,
                      help="SPREAD tasks over nodes, or PACK them.")
  parser.add_argument("--ready_timeout", type=float, default=120.0,
                      help="Seconds to wait for the placement group.")
  spare.add_argument(parser)
  description.add_data_workers_argument(parser)
  arguments.add_restart_arguments(parser)
  args = parser.parse_args(argv)
  arguments.finish_args(parser, args)
  args.spares_per_task = spare.count_from(parser, args)
  if args.cpus_per_task < 0 or args.gpus_per_task < 0:
    parser.error(f"--cpus_per_task and --gpus_per_task must be >= 0. "
                 f"Received: {args.cpus_per_task}, {args.gpus_per_task}")
  return args


def task_names(cluster):
  """Task names in bundle order: one bundle per task."""
  return [f"{role}:{index}" for role, count in cluster.counts().items()
          for index in range(count)]


def bundles(args, cluster=None):
  bundle = {"CPU": args.cpus_per_task}
  if args.gpus_per_task:
    bundle["GPU"] = args.gpus_per_task
  return [dict(bundle) for _ in task_names(cluster or args.cluster)]


def worker_slots(nodes, *, cpus_per_task, gpus_per_task, other_tasks,
                 left_out=(), available=None, held=0):
  """How many workers the live `nodes` (ray.nodes()) can hold, beside
  the job's `other_tasks` (chief, ps, evaluator), one task per bundle;
  nodes whose NodeID is in `left_out` do not count. On a cluster shared
  with other jobs, `available` (ray.available_resources(): what no one
  holds) bounds it, with the `held` bundles this job's own placement
  group already holds."""
  needs = [(r, n) for r, n in (("CPU", cpus_per_task),
                               ("GPU", gpus_per_task)) if n > 0]
  if not needs:
    return None  # Tasks that need nothing: the count says nothing.
  tasks = sum(min(int(node["Resources"].get(r, 0) // n) for r, n in needs)
              for node in nodes
              if node.get("Alive") and node.get("NodeID") not in left_out)
  if available is not None:
    tasks = min(tasks, held + min(int(available.get(r, 0) // n)
                                  for r, n in needs))
  return max(tasks - other_tasks, 0)


class RayJob:
  """The placement group and the actors of the current attempt."""

  def __init__(self, args, *, log, spares=None):
    self._args = args
    self._ray = ray_module
    self._log = log
    self._spares = spares  # ray_spares.ray_spares(), or None.
    self._names = task_names(args.cluster)
    self._group = None
    self._actors = {}  # task name -> actor handle
    self._taken = []  # Spare actors running this attempt's tasks.
    self._nodes = {}  # task name -> Ray node id, for the current attempt
    self._lost_nodes = set()  # Nodes that lost a worker for good.

  def reserve(self, cluster=None):
    """A placement group with a bundle per task of `cluster` (by default
    the job's); the previous group, if any, is removed first."""
    from ray.util.placement_group import placement_group
    from ray.util.placement_group import remove_placement_group
    cluster = cluster or self._args.cluster
    if self._group is not None:
      remove_placement_group(self._group)
    self._names = task_names(cluster)
    self._group = placement_group(
        bundles(self._args, cluster),
        strategy=self._args.placement_strategy)
    try:
      self._ray.get(self._group.ready(), timeout=self._args.ready_timeout)
    except self._ray.exceptions.GetTimeoutError:
      raise PlacementError(
          f"Ray could not place {len(self._names)} bundles of "
          f"{bundles(self._args)[0]} within {self._args.ready_timeout:g}s; "
          f"cluster resources: {self._ray.cluster_resources()}") from None

  def worker_slots(self):
    """The worker slots of the cluster's live nodes now (elastic)."""
    cluster = self._args.cluster
    return worker_slots(
        self._ray.nodes(), cpus_per_task=self._args.cpus_per_task,
        gpus_per_task=self._args.gpus_per_task,
        other_tasks=sum(cluster.counts().values()) - cluster.workers,
        left_out=self._lost_nodes,
        available=self._ray.available_resources(),
        held=len(self._names) if self._group is not None else 0)

  def drop_worker(self, spec):
    """The worker of TaskSpec `spec` is dropped for good: its node is
    left out of the slot count (Ray may still list a node that is gone
    as alive for a while)."""
    node = self._nodes.get(spec.name)
    if node:
      self._lost_nodes.add(node)
      self._log(f"node {node[:12]} is left out of the worker slots from "
                "now on.")

  def _new_actor(self, name):
    from ray.util.scheduling_strategies import \
        PlacementGroupSchedulingStrategy
    index = self._names.index(name)
    return ray_actor.TaskActor.options(
        num_cpus=self._args.cpus_per_task,
        num_gpus=self._args.gpus_per_task,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self._group,
            placement_group_bundle_index=index)).remote()

  def make_tasks(self, args):
    """One attempt: fresh actors, their addresses, every TF_CONFIG; a
    new placement group when the membership changed."""
    self.release_actors()
    if self._group is None or task_names(args.cluster) != self._names:
      started = time.monotonic()
      self.reserve(args.cluster)
      self._log(f"placement group ready: {len(self._names)} bundles of "
                f"{bundles(self._args)[0]}, {self._args.placement_strategy}"
                f", in {time.monotonic() - started:.1f}s")
    self._actors = {name: self._new_actor(name) for name in self._names}
    probed = self._ray.get([a.address.remote()
                            for a in self._actors.values()])
    self._nodes = dict(zip(self._names, self._ray.get(
        [a.node_id.remote() for a in self._actors.values()])))
    if self._spares:
      self._spares.plan(list(self._nodes.values()))
    addresses = {}
    for name, address in zip(self._names, probed):
      addresses.setdefault(name.split(":")[0], []).append(address)
    return description.task_commands(
        args.cluster, addresses=addresses, module=self._args.module,
        train_args=self._args.train_args)

  def spawn(self, spec, env):
    """Starts the task in its actor; a dead actor is replaced in its
    bundle first (same node, so the address in TF_CONFIG still holds)."""
    process = self._spawn_warm(spec, env)
    if process is None:
      actor = self._actors[spec.name]
      if not ray_actor.alive(self._ray, actor):
        actor = self._actors[spec.name] = self._new_actor(spec.name)
      process = ray_actor.RemoteProcess(
          self._ray, actor, spec.argv, env, cwd=os.getcwd(),
          scratch_root=self._args.scratch_root)
    self._log(f"{spec.name} runs in Ray actor pid={process.actor_pid}")
    return process

  def _spawn_warm(self, spec, env):
    """The task on a spare of its node, or None."""
    actor = self._spares and self._spares.pool(
        self._nodes[spec.name]).hand(spec.argv)
    if not actor:
      return None
    self._taken.append(actor)
    try:
      process = ray_actor.RemoteProcess(
          self._ray, actor, spec.argv, env, cwd=os.getcwd(), warm_only=True,
          scratch_root=self._args.scratch_root)
    except (ray_actor.NoSpare, self._ray.exceptions.RayError) as e:
      self._log(f"{spec.name} starts cold: its spare could not take it "
                f"({e})")
      return None
    process.warm = True
    return process

  def release_actors(self):
    for actor in [*self._actors.values(), *self._taken]:
      ray_actor.release(self._ray, actor)
    self._actors = {}
    self._taken = []

  def close(self):
    self.release_actors()
    if self._group is not None:
      from ray.util.placement_group import remove_placement_group
      remove_placement_group(self._group)
      self._group = None


class PlacementError(core.SlotsUnavailable):
  """Ray cannot place the job's bundles."""


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)

  def log(message):
    processes.write_line(sys.stdout, f"[launch] {message}")

  # The tasks' scratch directories on this machine, removed at the end,
  # also those of actors killed with their node.
  args.scratch_root = tempfile.mkdtemp(prefix="tfdist-ray-scratch-")
  try:
    with ray_session.session(address=args.address, log=log,
                             cpus_needed=len(task_names(args.cluster)) *
                             args.cpus_per_task):
      code = _launch(args, log)
  except ray_session.RayUnavailable as e:
    sys.exit(f"python -m launch.ray: error: {e}")
  finally:
    shutil.rmtree(args.scratch_root, ignore_errors=True)
  sys.exit(code)


def _service(args, log):
  """(the tf.data service of --data_workers in actors, a function that
  stops it and removes its journal), or (None, None)."""
  if not args.cluster.data_workers:
    return None, None
  from ray.util.scheduling_strategies import \
      NodeAffinitySchedulingStrategy
  actors, pinned = {}, {}

  def actor_for(name):
    """The actor of `name`, a new one if it is gone: the dispatcher's on
    its first node, whose address the trainers have and whose /tmp holds
    its journal."""
    if name not in actors or not ray_actor.alive(ray_module, actors[name]):
      options = {"num_cpus": 0}
      if name == "dispatcher" and pinned:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            node_id=pinned["node"], soft=False)
      actors[name] = ray_actor.TaskActor.options(**options).remote()
    return actors[name]

  pinned["node"] = ray_module.get(actor_for("dispatcher").node_id.remote())
  host, _, port = ray_module.get(
      actor_for("dispatcher").address.remote()).rpartition(":")
  journal = f"/tmp/tfdist-dispatcher-{os.getpid()}-{int(time.time())}"
  service = data_service.DataService(
      commands_by_name=data_service.commands(
          python=[sys.executable], port=int(port), host=host,
          work_dir=journal,
          data_workers=args.cluster.data_workers,
          module=data_service.REMOTE_MODULE, worker_address="auto"),
      start_process=lambda name, argv, env: ray_actor.RemoteProcess(
          ray_module, actor_for(name), argv, env, cwd=os.getcwd(),
          scratch_root=args.scratch_root),
      on_give_up=data_service.stop_launcher,
      log=log, write=lambda name, line: processes.write_line(
          sys.stdout, f"{name} | {line}"))
  args.train_args = [*args.train_args, f"--data_service=grpc://{host}:{port}"]

  def close():
    service.close()
    try:  # The journal, on the dispatcher's node.
      ray_actor.RemoteProcess(
          ray_module, actor_for("dispatcher"),
          [sys.executable, "-c", "import shutil, sys; "
           "shutil.rmtree(sys.argv[1], ignore_errors=True)", journal], {},
          cwd=os.getcwd()).wait(timeout=60)
    except (subprocess.TimeoutExpired, ray_module.exceptions.RayError):
      pass
    for actor in actors.values():
      ray_actor.release(ray_module, actor)
  return service, close


def _launch(args, log):
  service, close = _service(args, log)
  if service is None:
    return _launch_job(args, log)
  try:
    try:
      service.start()
    except (RuntimeError, OSError, ray_module.exceptions.RayError) as e:
      return f"python -m launch.ray: error: {e}"
    return _launch_job(args, log)
  finally:
    close()


def _launch_job(args, log):
  spares = None
  if args.spares_per_task and args.gpus_per_task:
    # A spare's actor holds no GPUs, so the task it ran would see the
    # node's devices as Ray left them, not its bundle's.
    log("warm spares are off with --gpus_per_task: each restart starts "
        "its tasks cold")
  elif args.spares_per_task:
    spares = ray_spares.ray_spares(ray_module, per_task=args.spares_per_task,
                                   cpus_per_task=args.cpus_per_task, log=log)
  job = RayJob(args, log=log, spares=spares)
  try:
    # The placement group is reserved with the first attempt's tasks: an
    # elastic job first waits for MIN worker slots among the live nodes.
    return core.Launcher(
        args, make_tasks=job.make_tasks, spawn=job.spawn,
        discover=job.worker_slots, drop_worker=job.drop_worker,
        discover_every_seconds=args.discovery_seconds,
        spares=spares).run()
  except PlacementError as e:
    return f"python -m launch.ray: error: {e}"
  finally:
    job.close()


if __name__ == "__main__":
  main()
