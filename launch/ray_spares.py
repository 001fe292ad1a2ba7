"""Warm spares for launch.ray: actors of their own beside a job's
tasks, each running `python -m launch.spare` on the node it is pinned to,
handed a task when the job restarts there."""

import collections
import os

from . import ray_actor
from . import spare


class RaySpares:
  """Warm spares in actors of their own, outside the placement group
  (no CPUs of their own: the task's bundle holds them) and pinned to a
  node: `per_task` for each task the node runs at once. A spare actor
  that gets a task is that task's actor from then on; another takes its
  place in the background."""

  def __init__(self, ray_module, *, per_task, cpus_per_task, log):
    self._ray = ray_module
    self._per_task = per_task
    # Ray gives a task's bundle actor OMP_NUM_THREADS of its CPUs; a
    # spare's actor has none of its own, and the import reads it.
    self._threads = str(max(1, int(cpus_per_task)))
    self._log = log
    self._pools = collections.defaultdict(list)  # node -> [(actor, pid)]
    self._wanted = collections.Counter()
    self._env = None

  def plan(self, nodes):
    """The nodes of an attempt's tasks, one entry per task. A node no
    task runs on now (gone, or left out) keeps no spares."""
    tasks = collections.Counter(nodes)
    for node in [n for n in self._pools if n not in tasks]:
      for actor, _ in self._pools.pop(node):
        ray_actor.release(self._ray, actor)
    self._wanted = collections.Counter({
        node: max(self._wanted[node], self._per_task * count)
        for node, count in tasks.items()})
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
    for node, wanted in self._wanted.items():
      while len(self._pools[node]) < wanted:
        actor = ray_actor.TaskActor.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                node, soft=False)).remote()
        self._pools[node].append(
            (actor, actor.warm.remote(spare.REMOTE_MODULE, self._env,
                                      os.getcwd())))

  def hand(self, node, argv):
    """A spare actor on `node` whose spare has started and waits, or None.
    One still starting is left for later: its task would wait for it
    longer than a cold start in the bundle's actor takes."""
    if spare.wants_native_logs(argv[3:]):
      return None
    pool, kept = self._pools[node], []
    try:
      while pool:
        actor, pid = pool.pop(0)
        ready, _ = self._ray.wait([pid], timeout=0)
        if not ready:
          kept.append((actor, pid))
          continue
        why = self._spare_exit(actor)
        if why is None:
          return actor
        self._log(f"a warm spare on node {node[:12]} {why}")
        ray_actor.release(self._ray, actor)
      return None
    finally:
      pool[:0] = kept
      self._fill()

  def _spare_exit(self, actor):
    try:
      return self._ray.get(actor.spare_exit.remote(), timeout=30)
    except (self._ray.exceptions.RayError,
            self._ray.exceptions.GetTimeoutError) as e:
      return f"is gone ({type(e).__name__})"

  @property
  def pids(self):
    """The pids of the spares started within 10 s (an actor takes about
    a second to start, and the launcher logs this as its tasks start)."""
    refs = [pid for pool in self._pools.values() for _, pid in pool]
    ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=10)
    pids = []
    for ref in ready:
      try:
        pids.append(self._ray.get(ref, timeout=5))
      except (self._ray.exceptions.RayError,
              self._ray.exceptions.GetTimeoutError):
        pass  # Its actor could not start the spare: hand() says why.
    return pids

  def close(self):
    for pool in self._pools.values():
      for actor, _ in pool:
        ray_actor.release(self._ray, actor)
    self._pools.clear()
