"""A lost peer costs no steps: each survivor keeps the state of its last
loop call that ended, and the next group resumes from the newest one.

On MultiWorkerMirrored every worker holds the whole state (the weights,
the optimizer's slots, the step) replicated. After each train loop call
that returns, `commit()` copies it into variables of this process's own.
When a peer is lost, `keep()` writes that copy, with no collective, as
model_dir/survivors/<task>/ckpt-N. The next group restores the newest
survivor state when it is newer than the last checkpoint
(tfdist.checkpoints), saves it as a checkpoint, and removes survivors/.

Why a copy, and not the live variables: a loop call that a lost peer
aborted may have applied some of its updates and not others (and the
step counter counts a call's steps at its end), so after it the live
variables are no state of the run. A call that returned ended its every
all-reduce, each a sum over all workers, so the copy is the run's true
state at its step. A survivor whose call was aborted holds the copy of
the call before; a survivor whose call ended holds the newer one. The two
are one call apart on the same trajectory; the newest is taken, and
ChiefBroadcast then gives every worker of the new group the chief's.

It does not apply where no single survivor holds the whole state:
--shard_optimizer (each worker holds 1/N of the slots), parameter
servers (the ps tasks hold the variables), a lone process (no peer to
survive it). Those resume from the last checkpoint.
"""

from absl import logging
import tensorflow as tf

from tfdist import errors
from tfdist import replica_check


def is_peer_loss(error):
  """A lost peer, raised by a loop call or outside one."""
  from tfdist import runners  # pylint: disable=g-import-not-at-top
  return isinstance(error, runners.PeerError) or (
      runners.is_collective_failure(error))


class SurvivorState:
  """Commits the replicated state after each loop call; keeps it on a
  lost peer.

  `variables`: every variable of the checkpoint (the model's weights, the
  optimizer's, the step); `step_variable`: the step, one of them.
  `write(step)`: writes the state now in `variables` as a survivor
  checkpoint (tfdist.checkpoints.CheckpointStore.write_survivor) and
  returns its path.
  """

  def __init__(self, *, variables, step_variable, write, task_name):
    variables = list(variables)
    if not any(v is step_variable for v in variables):
      raise ValueError("SurvivorState: step_variable must be one of "
                       f"variables. Received: {step_variable!r}")
    self._variables = variables
    self._step_index = next(i for i, v in enumerate(variables)
                            if v is step_variable)
    self._write = write
    self._task_name = task_name
    self._copies = None  # Made at the first commit, outside any scope.
    self._committed_step = None
    self._commit = tf.function(self._copy_in)
    self._put_back = tf.function(self._copy_out)

  @property
  def committed_step(self):
    return self._committed_step

  def _copy_in(self):
    for copy, variable in zip(self._copies, self._variables):
      copy.assign(replica_check.read_value(variable))

  def _copy_out(self):
    for copy, variable in zip(self._copies, self._variables):
      variable.assign(copy)

  def commit(self, step):
    """After a train loop call returned at `step`: its state is the run's."""
    if self._copies is None:
      self._copies = [tf.Variable(replica_check.read_value(v),
                                  trainable=False)
                      for v in self._variables]
    self._commit()
    self._committed_step = step

  def keep(self):
    """After a lost peer: writes the last committed state; returns its
    path, or None when no loop call had ended since the start."""
    if self._committed_step is None:
      logging.warning("%s lost a peer before any loop call ended here: "
                      "the next group resumes from the last checkpoint.",
                      self._task_name)
      return None
    step = int(self._copies[self._step_index].numpy())
    try:
      self._put_back()
      path = self._write(step)
    except Exception as e:  # pylint: disable=broad-except
      # Whatever went wrong here, the lost peer stays the task's error.
      logging.warning("%s lost a peer and could not write its state at "
                      "step %d (%s): the next group resumes from the last "
                      "checkpoint.", self._task_name, step,
                      errors.first_line(e))
      return None
    logging.warning("%s lost a peer; kept the state of its last loop call "
                    "that ended, step %d, in %s: the next group resumes "
                    "there and redoes no step.", self._task_name, step, path)
    return path
