"""Step runners: how a loop function is invoked on each kind of strategy.

The Trainer owns the outer loop; a runner only knows how to feed a loop
function its input and bring its results back to the host as numpy.
"""

import tensorflow as tf

from tfdist import preemption
from tfdist.errors import TfdistError


class PeerError(TfdistError):
  """Another task of the cluster stopped answering."""


class SyncRunner:
  """Strategies whose loop runs in this process: default, one_device,
  mirrored, tpu and multi_worker_mirrored."""

  def __init__(self, strategy, *, preemptible=True, task_name="local",
               peers=()):
    self._strategy = strategy
    self._preemptible = preemptible
    self._task_name = task_name
    self._peers = peers

  def preemption_guard(self, *, save_fn, step_fn):
    """Saves and exits on SIGTERM, at the same step on every worker."""
    if not self._preemptible:
      return preemption.NoGuard()
    return preemption.PreemptionGuard(
        cluster_resolver=getattr(self._strategy, "cluster_resolver", None),
        save_fn=save_fn, step_fn=step_fn)

  def make_iterator(self, input_fn):
    return iter(self._strategy.distribute_datasets_from_function(input_fn))

  def run(self, loop_fn, iterator, num_steps):
    try:
      results = loop_fn(iterator, tf.constant(num_steps, tf.int32))
      return tf.nest.map_structure(lambda t: t.numpy(), results)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.AbortedError) as e:
      if not self._peers:
        raise
      what = ("timed out (--collective_timeout)" if isinstance(
          e, tf.errors.DeadlineExceededError) else "lost a peer")
      raise PeerError(
          f"a collective on {self._task_name} {what}: a peer stopped "
          f"answering. Peers: {', '.join(self._peers)}.") from None


def create(strategy_info):
  """Returns the runner for `strategy_info.name`."""
  if strategy_info.name in ("default", "one_device", "mirrored", "tpu",
                            "multi_worker_mirrored"):
    return SyncRunner(strategy_info.strategy,
                      preemptible=strategy_info.name != "tpu",
                      task_name=strategy_info.task_name,
                      peers=strategy_info.peers)
  raise ValueError(f"Unrecognized strategy for a runner: "
                   f"{strategy_info.name!r}")
