"""Warm spares for launch.ray: actors of their own beside a job's
tasks, each running `python -m launch.spare` on the node it is pinned to,
handed a task when the job restarts there."""

import os

from . import ray_actor
from . import spare


def ray_spares(ray_module, *, per_task, cpus_per_task, log):
  """A NodeSpares on every node the tasks run on (launch.spare.HostPools,
  as launch.ssh keeps a pool on every host)."""
  # Ray gives a task's bundle actor OMP_NUM_THREADS of its CPUs; a spare's
  # actor has none of its own, and the import reads it.
  threads = str(max(1, int(cpus_per_task)))
  return spare.HostPools(
      make_pool=lambda node: NodeSpares(ray_module, node=node,
                                        threads=threads, log=log),
      per_task=per_task,
      pids_of=lambda pools: ready_pids(
          ray_module, [ref for pool in pools for ref in pool.pid_refs]))


def ready_pids(ray_module, refs):
  """The pids of the spares (refs of their pids) started within 10 s, all
  nodes at once (an actor takes about a second to start, and the
  launcher logs this as its tasks start)."""
  ready, _ = ray_module.wait(refs, num_returns=len(refs), timeout=10)
  pids = []
  for ref in ready:
    try:
      pids.append(ray_module.get(ref, timeout=5))
    except (ray_module.exceptions.RayError,
            ray_module.exceptions.GetTimeoutError):
      pass  # Its actor could not start the spare: hand() says why.
  return pids


class NodeSpares:
  """Warm spares in actors of their own on one node, outside the
  placement group (no CPUs of their own: the task's bundle holds them).
  A spare actor that gets a task is that task's actor from then on;
  another takes its place in the background."""

  def __init__(self, ray_module, *, node, threads, log):
    self._ray = ray_module
    self._node = node
    self._threads = threads
    self._log = log
    self._pool = []  # [(actor, its spare's pid as a ref)]
    self._count = 0
    self._env = None

  def grow_to(self, count):
    self._count = max(self._count, count)
    self._fill()

  def start(self, env):
    self._env = {"OMP_NUM_THREADS": self._threads, **{
        k: v for k, v in env.items() if k == "PYTHONUNBUFFERED"}}
    self._fill()

  def _fill(self):
    if self._env is None:
      return
    from ray.util.scheduling_strategies import \
        NodeAffinitySchedulingStrategy
    while len(self._pool) < self._count:
      actor = ray_actor.TaskActor.options(
          num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
              self._node, soft=False)).remote()
      self._pool.append(
          (actor, actor.warm.remote(spare.REMOTE_MODULE, self._env,
                                    os.getcwd())))

  def hand(self, argv):
    """A spare actor whose spare has started and waits, or None. One
    still starting is left for later: its task would wait for it longer
    than a cold start in the bundle's actor takes."""
    if spare.wants_native_logs(argv[3:]):
      return None
    kept = []
    try:
      while self._pool:
        actor, pid = self._pool.pop(0)
        ready, _ = self._ray.wait([pid], timeout=0)
        if not ready:
          kept.append((actor, pid))
          continue
        why = self._spare_exit(actor)
        if why is None:
          return actor
        self._log(f"a warm spare on node {self._node[:12]} {why}")
        ray_actor.release(self._ray, actor)
      return None
    finally:
      self._pool[:0] = kept
      self._fill()

  def _spare_exit(self, actor):
    try:
      return self._ray.get(actor.spare_exit.remote(), timeout=30)
    except (self._ray.exceptions.RayError,
            self._ray.exceptions.GetTimeoutError) as e:
      return f"is gone ({type(e).__name__})"

  @property
  def pid_refs(self):
    return [pid for _, pid in self._pool]

  @property
  def pids(self):  # One node's (HostPools waits on all at once).
    return ready_pids(self._ray, self.pid_refs)

  def close(self):
    for actor, _ in self._pool:
      ray_actor.release(self._ray, actor)
    self._pool = []
