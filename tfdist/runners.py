"""Step runners: how the compiled loops run on each kind of strategy.

The Trainer owns the outer loop and asks a runner for "N more train steps"
or "an eval pass". A runner splits the steps into `steps_per_loop` calls and
brings the results back to the host as LoopSums:
- SyncRunner calls the loop function in this process, one call at a time
  (default, one_device, mirrored, tpu, multi_worker_mirrored);
- ParameterServerRunner schedules every call on the workers through a
  ClusterCoordinator, then joins, and evaluates on the coordinator itself.
"""

import contextlib
import functools
import os
import re
from typing import Protocol

import tensorflow as tf

from tfdist import errors
from tfdist import loop_wire
from tfdist import preemption
from tfdist import stall_watch
from tfdist import strategies
from tfdist.errors import PEER_LOST_EXIT_CODE
from tfdist.errors import TfdistError


class Runner(Protocol):
  """The contract between the Trainer and a strategy's way of running."""

  # True when every replica's slice of a global batch comes from one seeded
  # stream (synchronous training); False gives each worker its own order.
  same_data_everywhere: bool
  # True when loop calls run one after another in this process (so the
  # Trainer may stop between any two); False when they run on workers at
  # once (parameter servers).
  one_call_at_a_time: bool

  def preemption_watched(self, *, save_fn, step_fn, grace_seconds):
    """A context: on SIGTERM, call save_fn, then stop with PreemptedError;
    exit within `grace_seconds` whatever happens, until the watch it gives
    is disarmed (nothing is left to save)."""

  def make_iterator(self, input_fn):
    """An iterator over the train batches of `input_fn`."""

  def run_steps(self, iterator, num_steps, steps_per_call, first_step
                ) -> loop_wire.LoopSums:
    """Trains `num_steps` steps from `first_step`, counting them in the
    global step."""

  def evaluate(self, input_fn, num_steps) -> loop_wire.LoopSums:
    """One exact eval pass of `num_steps` global batches. It never saves:
    the eval may run on other weights (the moving average)."""

  def stop_if_signalled(self, sums):
    """After an eval, with the trained weights back: save and stop with
    PreemptedError when a SIGTERM was agreed (SyncRunner: `sums.stop`)."""


class PeerError(TfdistError):
  """Another task of the cluster stopped answering."""

  exit_code = PEER_LOST_EXIT_CODE


class InputEndedError(TfdistError):
  """A task's own input ran out mid-run."""


_INPUT_ENDED = ("the input ended before the steps asked of it: a task's "
                "train_input must repeat for ever (end it with .repeat())")


# What a collective raises when a peer is gone or stalled.
COLLECTIVE_FAILURES = (tf.errors.DeadlineExceededError,
                       tf.errors.UnavailableError, tf.errors.AbortedError,
                       tf.errors.CancelledError)


def is_collective_failure(error):
  return isinstance(error, COLLECTIVE_FAILURES) and any(
      word in error.message.lower() for word in ("collective", "recvbuf"))


@contextlib.contextmanager
def peer_losses_named(task_name, peers):
  """A collective that fails outside a loop call (the callbacks'
  agreement, the restore's broadcast, the replica check, a sharded save)
  is a lost peer too: exit 5, never taken for this task's own error."""
  try:
    yield
  except COLLECTIVE_FAILURES as e:
    if not peers or not is_collective_failure(e):
      raise
    raise PeerError(f"a collective on {task_name} outside a loop call lost "
                    f"a peer: a peer stopped answering. Peers: "
                    f"{', '.join(peers)}.") from None


def _chunks(num_steps, steps_per_call):
  while num_steps > 0:
    size = min(steps_per_call, num_steps)
    yield size
    num_steps -= size


def combine(parts):
  """Sums LoopSums in step order."""
  return functools.reduce(loop_wire.LoopSums.add, parts,
                          loop_wire.LoopSums())


def _failed_task(error):
  found = re.search(r"/job:(\w+)/replica:\d+/task:(\d+)", error.message)
  return f"{found.group(1)}:{found.group(2)}" if found else "a task"


def plain_input_context(strategy):
  """The InputContext of this process when it runs the one replica of a
  (multi-worker) mirrored strategy on a CPU, else None.

  Such a process feeds its train steps from a plain tf.data iterator, whose
  batch strategy.run hands to its one replica: TF's distributed iterator
  costs about 60 ms of system CPU per step on one core
  (tools/bench_input.py). On GPUs it also prefetches to the device, so they
  keep it; so do eval passes (finite, padded)."""
  if not isinstance(strategy, (tf.distribute.MirroredStrategy,
                               tf.distribute.MultiWorkerMirroredStrategy)):
    return None
  devices = strategy.extended.worker_devices
  if (len(devices) != 1 or
      tf.DeviceSpec.from_string(devices[0]).device_type != "CPU"):
    return None
  # MultiWorkerMirrored's own context (pipelines = workers, this task's
  # id); MirroredStrategy's is one pipeline. One pipeline on several
  # workers would give each the same slice: no silent fallback.
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    make = getattr(strategy.extended, "_make_input_context", None)
    if make is None:
      raise TfdistError(
          "this TensorFlow has no MultiWorkerMirroredStrategy."
          "extended._make_input_context, which the plain train feed needs "
          "to know this worker's slice: use --train_feed=distributed.")
    return make()
  return tf.distribute.InputContext(
      num_input_pipelines=1, input_pipeline_id=0,
      num_replicas_in_sync=strategy.num_replicas_in_sync)


class SyncRunner:
  """Runs loop functions in this process."""

  same_data_everywhere = True
  one_call_at_a_time = True

  def __init__(self, strategy, loops, *, preemptible=True, task_name="local",
               peers=(), plain_feed=True, collective_timeout=0.0,
               survivor=None, scratch_dir=None):
    self._strategy = strategy
    # The at-once exits (stall, SIGTERM unsaved) remove a non-chief's
    # scratch model_dir: they skip the unwinding that would.
    self._exit_fn = (errors.exit_removing(scratch_dir) if scratch_dir
                     else os._exit)  # pylint: disable=protected-access
    # A tfdist.survivor.SurvivorState, committed after each train call.
    self._survivor = survivor
    self._loops = loops
    self._train = tf.function(self._counted_train_steps)
    self._eval = tf.function(loops.eval_steps)
    self._preemptible = preemptible
    self._plain_feed = plain_feed  # --train_feed=auto
    self._task_name = task_name
    self._peers = peers
    self._sigterm = None
    self._save_fn = self._step_fn = None
    self._stall_watch = (stall_watch.StallWatch(
        timeout_seconds=collective_timeout,
        message=self._peer_message(timed_out=True), exit_fn=self._exit_fn)
                         if peers and collective_timeout else None)

  @contextlib.contextmanager
  def preemption_watched(self, *, save_fn, step_fn, grace_seconds):
    """On SIGTERM: save and exit, at the same step on every worker."""
    if not self._preemptible:
      yield preemption.Unwatched()
      return
    self._sigterm = preemption.SigtermFlag(grace_seconds=grace_seconds,
                                           task_name=self._task_name,
                                           exit_fn=self._exit_fn)
    self._save_fn, self._step_fn = save_fn, step_fn
    try:
      yield self._sigterm
    finally:
      self._sigterm.close()
      self._sigterm = None

  def make_iterator(self, input_fn):
    context = (plain_input_context(self._strategy) if self._plain_feed
               else None)
    if context is not None:
      dataset = input_fn(context)
      # A stream that may end keeps TF's iterator, which ends it on every
      # worker at once.
      if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        return iter(dataset)
    return iter(self._strategy.distribute_datasets_from_function(input_fn))

  def _counted_train_steps(self, iterator, num_steps, stop, compressed):
    sums = self._loops.train_steps(iterator, num_steps, compressed, stop)
    self._loops.count_steps(num_steps)
    return sums

  def run_steps(self, iterator, num_steps, steps_per_call, first_step):
    """Each call counts its steps in the global step as it ends. No call
    spans the step where the compressed all-reduce starts."""
    parts, step, end = [], first_step, first_step + num_steps
    while step < end:
      compressed, change = self._loops.reducer.compressed_from(step)
      until = min(end, change) if change else end
      train = functools.partial(self._train, compressed=compressed)
      for size in _chunks(until - step, steps_per_call):
        parts.append(self._loops.wire.unpack_train(
            self._call(train, iterator, size,
                       watch_key=("train", compressed, size)), size))
        step += size
        if self._survivor:
          self._survivor.commit(step)
        self._stop_if_agreed(parts[-1])
    return combine(parts)

  def evaluate(self, input_fn, num_steps):
    # Eval passes keep TF's iterator: finite and padded.
    iterator = iter(self._strategy.distribute_datasets_from_function(
        input_fn))
    return self._loops.wire.unpack_eval(
        self._call(self._eval, iterator, num_steps,
                   watch_key=("eval", num_steps)), num_steps)

  def stop_if_signalled(self, sums):
    self._stop_if_agreed(sums)

  def _stop_if_agreed(self, sums):
    """Every task sees the same `stop`, after the same call."""
    if sums.stop and self._sigterm:
      self._sigterm.save_and_stop(self._save_fn, self._step_fn)

  def _call(self, loop_fn, iterator, num_steps, *, watch_key):
    if self._sigterm:
      self._sigterm.raise_if_interrupted()
    stop = float(bool(self._sigterm and self._sigterm.requested))
    watched = (self._stall_watch.watching(watch_key) if self._stall_watch
               else contextlib.nullcontext())
    try:
      with watched:
        return loop_fn(iterator, tf.constant(num_steps, tf.int32),
                       tf.constant(stop, tf.float32)).numpy()
    except tf.errors.OutOfRangeError:
      raise InputEndedError(
          f"{_INPUT_ENDED}, and its eval_input must give --eval_steps "
          "batches.") from None
    except COLLECTIVE_FAILURES as e:
      # With several collectives in flight (the overlapped packs), the one
      # that timed out may cancel the others, and which error surfaces
      # first varies: its message still says it was a timeout.
      if not self._peers:
        raise
      timed_out = isinstance(e, tf.errors.DeadlineExceededError) or any(
          word in e.message.lower() for word in ("deadline", "timeout",
                                                 "timed out"))
      raise PeerError(self._peer_message(timed_out=timed_out)) from None

  def _peer_message(self, *, timed_out):
    what = ("timed out (--collective_timeout)" if timed_out
            else "lost a peer")
    return (f"a collective on {self._task_name} {what}: a peer stopped "
            f"answering. Peers: {', '.join(self._peers)}.")


class ParameterServerRunner:
  """Schedules loop calls on workers; the coordinator never trains."""

  # Async workers must not all read the same batches: unseeded shuffles.
  same_data_everywhere = False
  one_call_at_a_time = False

  def __init__(self, strategy, loops, coordinator):
    self._strategy = strategy
    self._loops = loops
    self._coordinator = coordinator
    self._guard = None
    # The PS-only loop variants: train calls do not count their steps (the
    # coordinator does), and eval runs here without strategy.run.
    # Two tensor arguments only: the coordinator's remote functions do not
    # keep Python defaults. PS has no compressed all-reduce.
    self._train = tf.function(self._plain_train_steps)
    self._local_eval = tf.function(self._local_eval_steps)

  @contextlib.contextmanager
  def preemption_watched(self, *, save_fn, step_fn, grace_seconds):
    """SIGTERM is checked after joins (workers run on asynchronously)."""
    self._guard = preemption.SigtermGuard(save_fn=save_fn, step_fn=step_fn,
                                          grace_seconds=grace_seconds)
    try:
      yield self._guard
    finally:
      self._guard.close()
      self._guard = None

  def make_iterator(self, input_fn):
    def per_worker_dataset():
      return self._strategy.distribute_datasets_from_function(input_fn)
    return iter(self._coordinator.create_per_worker_dataset(
        per_worker_dataset))

  def run_steps(self, iterator, num_steps, steps_per_call, first_step):  # pylint: disable=unused-argument
    """All calls are queued at once so every worker stays busy.

    A call lost with a failed worker is re-dispatched by the coordinator,
    and may already have counted its steps before it was lost; so the
    coordinator counts the steps of the calls whose results came back,
    which makes the global step end exactly at the requested step.
    """
    try:
      scheduled = [(self._coordinator.schedule(
          self._train,
          args=(iterator, tf.constant(size, tf.int32))), size)
                   for size in _chunks(num_steps, steps_per_call)]
      if self._guard:
        with self._guard.joining():
          self._coordinator.join()
      else:
        self._coordinator.join()
      results = [(remote.fetch(), size) for remote, size in scheduled]
    except tf.errors.OutOfRangeError:
      raise InputEndedError(f"{_INPUT_ENDED}.") from None
    except tf.errors.OpError as e:
      # Worker failures are retried by the coordinator; what reaches here
      # is a lost parameter server (or a bug), which needs a job restart.
      raise PeerError(f"the coordinator lost {_failed_task(e)}: "
                      f"{errors.first_line(e)}") from None
    self._loops.count_steps(sum(size for _, size in results))
    if self._guard:
      self._guard.save_and_exit_if_signalled()
    return combine(self._loops.wire.unpack_train(vector, size)
                   for vector, size in results)

  def _plain_train_steps(self, iterator, num_steps):
    return self._loops.train_steps(iterator, num_steps, compressed=False,
                                   stop=0.0)

  def _local_eval_steps(self, iterator, num_steps):
    loops = self._loops
    state = loops.eval_zeros()
    for _ in tf.range(num_steps):
      state = loops.eval_step(next(iterator), state)
    return loops.wire.pack_eval(state, 0.0)

  def evaluate(self, input_fn, num_steps):
    """Exact eval on the coordinator: one pipeline, every example once.

    Scheduled eval could count an example twice when a closure is retried.
    """
    dataset = input_fn(tf.distribute.InputContext())
    vector = self._local_eval(iter(dataset), tf.constant(num_steps, tf.int32))
    return self._loops.wire.unpack_eval(vector.numpy(), num_steps)

  def stop_if_signalled(self, sums):
    del sums  # A SIGTERM that came during the eval.
    if self._guard:
      self._guard.save_and_exit_if_signalled()


def create(strategy_info, loops, *, train_feed="auto", survivor=None,
           scratch_dir=None):
  """The runner the strategy table names for `strategy_info.name`.
  `survivor`: a synchronous runner commits it after each train call.
  `scratch_dir`: a non-chief's model_dir, removed by an exit at once."""
  kind = strategies.kind(strategy_info.name)
  if kind.runner == "parameter_server":
    return ParameterServerRunner(strategy_info.strategy, loops,
                                 strategy_info.coordinator)
  return SyncRunner(strategy_info.strategy, loops,
                    preemptible=kind.preemptible,
                    task_name=strategy_info.task_name,
                    peers=strategy_info.peers,
                    plain_feed=train_feed == "auto",
                    collective_timeout=strategy_info.collective_timeout,
                    survivor=survivor, scratch_dir=scratch_dir)
