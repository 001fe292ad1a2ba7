"""Step runners: how loop functions run on each kind of strategy.

The Trainer owns the outer loop and asks a runner for "N more train steps"
or "an eval pass". A runner splits the steps into `steps_per_loop` calls and
brings the results back to the host as numpy:
- SyncRunner calls the loop function in this process, one call at a time
  (default, one_device, mirrored, tpu, multi_worker_mirrored);
- ParameterServerRunner schedules every call on the workers through a
  ClusterCoordinator, then joins, and evaluates on the coordinator itself.
"""

import re

import numpy as np
import tensorflow as tf

from tfdist import preemption
from tfdist.errors import TfdistError


class PeerError(TfdistError):
  """Another task of the cluster stopped answering."""


def _chunks(num_steps, steps_per_call):
  while num_steps > 0:
    size = min(steps_per_call, num_steps)
    yield size
    num_steps -= size


def combine(results):
  """Joins per-call results [(sums, num_steps)] into one dict.

  `step_loss` holds one entry per step; every other entry is a sum.
  """
  combined = {}
  for sums, num_steps in results:
    for name, value in sums.items():
      if name == "step_loss":
        combined.setdefault(name, []).append(np.asarray(value)[:num_steps])
      else:
        combined[name] = combined.get(name, 0.0) + float(value)
  if "step_loss" in combined:
    combined["step_loss"] = np.concatenate(combined["step_loss"])
  return combined


def _failed_task(error):
  found = re.search(r"/job:(\w+)/replica:\d+/task:(\d+)", error.message)
  return f"{found.group(1)}:{found.group(2)}" if found else "a task"


def _to_numpy(results):
  return tf.nest.map_structure(lambda t: t.numpy(), results)


class SyncRunner:
  """Runs loop functions in this process."""

  # Every replica's slice of a global batch comes from one seeded stream.
  same_data_everywhere = True

  def __init__(self, strategy, *, preemptible=True, task_name="local",
               peers=()):
    self._strategy = strategy
    self._preemptible = preemptible
    self._task_name = task_name
    self._peers = peers
    self._guard = preemption.NoGuard()

  def watch_preemption(self, *, save_fn, step_fn):
    """On SIGTERM: save and exit, at the same step on every worker."""
    if self._preemptible:
      self._guard = preemption.PreemptionGuard(
          cluster_resolver=getattr(self._strategy, "cluster_resolver", None),
          save_fn=save_fn, step_fn=step_fn)

  def make_iterator(self, input_fn):
    return iter(self._strategy.distribute_datasets_from_function(input_fn))

  def run_steps(self, loops, iterator, num_steps, steps_per_call):
    """Each call counts its steps in the global step as it ends."""
    results = []
    for size in _chunks(num_steps, steps_per_call):
      results.append((self._guard.run(self._call, loops.train_loop, iterator,
                                      size), size))
    return combine(results)

  def evaluate(self, loops, input_fn, num_steps):
    return self._call(loops.eval_loop, self.make_iterator(input_fn),
                      num_steps)

  def _call(self, loop_fn, iterator, num_steps):
    try:
      return _to_numpy(loop_fn(iterator, tf.constant(num_steps, tf.int32)))
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.AbortedError) as e:
      if not self._peers:
        raise
      what = ("timed out (--collective_timeout)" if isinstance(
          e, tf.errors.DeadlineExceededError) else "lost a peer")
      raise PeerError(
          f"a collective on {self._task_name} {what}: a peer stopped "
          f"answering. Peers: {', '.join(self._peers)}.") from None


class ParameterServerRunner:
  """Schedules loop calls on workers; the coordinator never trains."""

  # Async workers must not all read the same batches: unseeded shuffles.
  same_data_everywhere = False

  def __init__(self, strategy, coordinator):
    self._strategy = strategy
    self._coordinator = coordinator
    self._guard = None

  def watch_preemption(self, *, save_fn, step_fn):
    """TF's handler does not support PS: SIGTERM is checked after joins."""
    self._guard = preemption.SigtermGuard(save_fn=save_fn, step_fn=step_fn)

  def make_iterator(self, input_fn):
    def per_worker_dataset():
      return self._strategy.distribute_datasets_from_function(input_fn)
    return iter(self._coordinator.create_per_worker_dataset(
        per_worker_dataset))

  def run_steps(self, loops, iterator, num_steps, steps_per_call):
    """All calls are queued at once so every worker stays busy.

    A call lost with a failed worker is re-dispatched by the coordinator,
    and may already have counted its steps before it was lost; so the
    coordinator counts the steps of the calls whose results came back,
    which makes the global step end exactly at the requested step.
    """
    try:
      scheduled = [(self._coordinator.schedule(
          loops.uncounted_train_loop,
          args=(iterator, tf.constant(size, tf.int32))), size)
                   for size in _chunks(num_steps, steps_per_call)]
      self._coordinator.join()
      results = [(remote.fetch(), size) for remote, size in scheduled]
    except tf.errors.OpError as e:
      # Worker failures are retried by the coordinator; what reaches here
      # is a lost parameter server (or a bug), which needs a job restart.
      raise PeerError(f"the coordinator lost {_failed_task(e)}: "
                      f"{e.message.splitlines()[0][:160]}") from None
    loops.count_steps(sum(size for _, size in results))
    if self._guard:
      self._guard.save_and_exit_if_signalled()
    return combine(results)

  def evaluate(self, loops, input_fn, num_steps):
    """Exact eval on the coordinator: one pipeline, every example once.

    Scheduled eval could count an example twice when a closure is retried.
    """
    dataset = input_fn(tf.distribute.InputContext())
    return _to_numpy(loops.local_eval_loop(
        iter(dataset), tf.constant(num_steps, tf.int32)))


def create(strategy_info):
  """Returns the runner for `strategy_info.name`."""
  if strategy_info.name in ("default", "one_device", "mirrored", "tpu",
                            "multi_worker_mirrored"):
    return SyncRunner(strategy_info.strategy,
                      preemptible=strategy_info.name != "tpu",
                      task_name=strategy_info.task_name,
                      peers=strategy_info.peers)
  if strategy_info.name == "parameter_server":
    return ParameterServerRunner(strategy_info.strategy,
                                 strategy_info.coordinator)
  raise ValueError(f"Unrecognized strategy for a runner: "
                   f"{strategy_info.name!r}")
