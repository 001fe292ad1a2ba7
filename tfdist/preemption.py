"""SIGTERM → checkpoint → distinct exit, agreed across all workers.

TF's PreemptionCheckpointHandler does the cluster-wide agreement: the worker
that gets SIGTERM tells its peers at which loop call to stop, so every worker
saves at the same step and none is left waiting in a collective. It is given
a throw-away checkpoint to restore and track, so it never touches the run's
own checkpoints (tfdist.checkpoints restores those, skipping corrupt ones).
"""

import signal
import tempfile

import tensorflow as tf

from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.errors import TfdistError


class PreemptedError(TfdistError):
  """Raised after the preemption checkpoint is written."""

  exit_code = PREEMPTED_EXIT_CODE


class PreemptionGuard:
  """Runs loop calls under TF's handler; `save_fn()` writes the checkpoint."""

  def __init__(self, *, cluster_resolver, save_fn, step_fn):
    self._save_fn = save_fn
    self._step_fn = step_fn
    # Never written to (save_fn replaces the handler's own save); removed
    # with this object.
    self._scratch_dir = tempfile.TemporaryDirectory(prefix="tfdist-preempt-")
    scratch = tf.train.CheckpointManager(
        tf.train.Checkpoint(), self._scratch_dir.name, max_to_keep=1)
    self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
        cluster_resolver, scratch,
        termination_config=tf.distribute.experimental.TerminationConfig(
            save_fn=self._save, exit_fn=self._exit, grace_period=0))

  def _save(self, *unused_args, **unused_kwargs):
    self._save_fn()

  def _exit(self):
    raise PreemptedError(
        f"preempted (SIGTERM): checkpoint saved at step {self._step_fn()}; "
        f"exiting with code {PREEMPTED_EXIT_CODE} so the launcher resumes.")

  def run(self, fn, *args):
    return self._handler.run(fn, *args)


class SigtermGuard:
  """For parameter-server coordinators: SIGTERM sets a flag that is checked
  when all scheduled steps have joined; then the chief saves and exits.

  If no worker is left to finish the scheduled steps, the join never
  returns; a second SIGTERM (the launcher sends one when every worker is
  gone) saves at once, with the steps counted so far, and stops.
  """

  def __init__(self, *, save_fn, step_fn):
    self._save_fn = save_fn
    self._step_fn = step_fn
    self._signalled = False
    signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):
    del signum, frame
    if self._signalled:
      self._save_and_exit()
    self._signalled = True

  def _save_and_exit(self):
    self._save_fn()
    raise PreemptedError(
        f"preempted (SIGTERM): checkpoint saved at step "
        f"{self._step_fn()}; exiting with code {PREEMPTED_EXIT_CODE}.")

  def save_and_exit_if_signalled(self):
    if self._signalled:
      self._save_and_exit()


class NoGuard:
  """For synchronous strategies TF's handler does not support (TPU). PS
  coordinators use SigtermGuard."""

  def run(self, fn, *args):
    return fn(*args)
