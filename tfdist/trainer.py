"""The one outer loop: train, eval, checkpoint, summaries, export.

The Trainer is handed its parts (tfdist.builder makes them), as Orbit's
Controller is: the model, the optimizer, a step runner (tfdist.runners),
the checkpoint store and the summaries. How steps run on each strategy
lives in the runner; this loop is the same for all of them.
"""

import contextlib
import dataclasses
import time
from typing import Callable, Optional

from absl import logging
import numpy as np

from tfdist import progress
from tfdist import survivor as survivor_lib
from tfdist.errors import NonFiniteLossError


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What a finished run reports."""

  step: int
  eval_metrics: dict
  train_metrics: dict
  checkpoint: Optional[str]
  export_dir: Optional[str]
  seconds: float


@dataclasses.dataclass(frozen=True)
class LoopOptions:
  """The loop section of the options: the cadence of the outer loop."""

  train_steps: int
  batch_size: int
  steps_per_loop: int
  log_every: int
  eval_every: int = 0
  eval_steps: int = 0
  checkpoint_every: int = 0
  check_replicas_every: int = 0
  profile_steps: Optional[tuple] = None
  seed: int = 42
  sigterm_grace_seconds: float = 25.0
  mode: str = "train_and_eval"

  @property
  def evaluates(self):
    return self.mode != "train"

  @classmethod
  def from_config(cls, config):
    return cls(**{f.name: getattr(config, f.name)
                  for f in dataclasses.fields(cls)})


def _next_multiple(step, every):
  return (step // every + 1) * every


class Trainer:
  """Runs one training job with the parts it is given."""

  def __init__(self, *, options: LoopOptions, model, optimizer, global_step,
               runner, loops, checkpoints, summaries, inputs, eval_pass,
               describe, learning_rate: Callable[[int], float],
               replica_checker=None, export_fn=None, after_restore=None,
               hparams: Optional[dict] = None, startup_scalars=None,
               chief_broadcast=None, callbacks=None, best=None,
               warm_start=None, survivor=None):
    self._options = options
    self.model = model
    self.optimizer = optimizer
    self.global_step = global_step
    self._runner = runner
    self._metrics = loops.metrics
    self._checkpoints = checkpoints
    self._summaries = summaries
    self._inputs = inputs  # A tfdist.data.Inputs: its train_fn.
    self._eval_pass = eval_pass  # A tfdist.evaluation.EvalPass.
    self._describe = describe  # "mlp on digits with default".
    self._learning_rate = learning_rate
    self._replica_checker = replica_checker
    self._export_fn = export_fn
    self._after_restore = after_restore
    self._hparams = hparams or {}
    self._startup_scalars = startup_scalars or {}
    # Multi-worker: makes every worker take the chief's state after the
    # restore (tfdist.replica_check.ChiefBroadcast).
    self._chief_broadcast = chief_broadcast
    # A tfdist.callbacks.Callbacks: Keras callbacks, and their stop.
    self._callbacks = callbacks
    # A tfdist.evaluation.BestKeeper: keeps the best eval's checkpoint and
    # export, and stops early.
    self._best = best
    # Loads the model's weights from another run when model_dir has no
    # checkpoint (--init_checkpoint); its source, for the log.
    self._warm_start = warm_start
    # A tfdist.survivor.SurvivorState: written when a peer is lost, so the
    # next group redoes no step (its runner commits it).
    self._survivor = survivor
    self._last_checkpoint = None
    self._eval_sums = None
    self._iterator, self._iterator_step = None, None
    self._saved_step = None
    self._last_eval = (None, None)  # (step, metrics)

  # Public --------------------------------------------------------------

  def run(self) -> RunResult:
    """Resumes from model_dir if it can, then trains to train_steps."""
    options = self._options
    started = time.perf_counter()
    self.restore()
    self._summaries.hparams(self._hparams)
    if self._startup_scalars:
      self._summaries.scalars("train", self.step, self._startup_scalars)
    train_metrics = {}
    # Only a training run saves on SIGTERM (not a sidecar evaluator).
    watched = self._runner.preemption_watched(
        save_fn=self._save_unless_saved, step_fn=lambda: self.step,
        grace_seconds=options.sigterm_grace_seconds)
    callbacks = self._callbacks
    try:
      with watched as watch, self._survivor_kept():
        if self._best:  # Watched: a SIGTERM during it ends the task well.
          self._finish_pending_export()
        if callbacks:
          callbacks.train_begin(self.step)
        stopped = self._stopped_before()
        if self.step < options.train_steps and not stopped:
          train_metrics = self.train(options.train_steps)
          self._save_unless_saved()
        eval_metrics = {}
        if options.evaluates:
          eval_step, eval_metrics = self._last_eval
          if eval_step != self.step:  # Not evaluated just before a stop.
            eval_metrics = self.evaluate(self.step)
            if stopped:  # That eval was counted before the stop.
              self._runner.stop_if_signalled(self._eval_sums)
            else:
              self._after_eval(self.step, eval_metrics, train_metrics)
        # Trained, saved and evaluated: a SIGTERM from here on lets the
        # export finish (its watchdog would end the process mid-export).
        watch.disarm()
        export_dir = self._export_fn() if self._export_fn else None
        if callbacks:
          callbacks.train_end(train_metrics)
    finally:
      self._summaries.close()
    return RunResult(step=self.step, eval_metrics=eval_metrics,
                     train_metrics=train_metrics,
                     checkpoint=self._last_checkpoint, export_dir=export_dir,
                     seconds=time.perf_counter() - started)

  def _stopped_before(self):
    """Early stopping decided at the eval of the restored step (the eval
    a preemption interrupted saved it): the run stops there, as it would
    have uninterrupted, not one eval interval later."""
    if not (self._best and self._best.tracker.stopped_at_step(self.step)):
      return False
    logging.info("Early stopping was decided at the eval of step %d, "
                 "before this run resumed: not training further.", self.step)
    return True

  @contextlib.contextmanager
  def _survivor_kept(self):
    """A lost peer: this survivor writes its last committed state, inside
    the SIGTERM watch (a launcher's SIGTERM only raises its flag)."""
    try:
      yield
    except Exception as e:
      if self._survivor and survivor_lib.is_peer_loss(e):
        self._survivor.keep()
      raise

  @property
  def step(self):
    return int(self.global_step.numpy())

  def restore(self):
    """Restores the newest usable checkpoint in model_dir, if any."""
    restored = self._checkpoints.restore()
    if self._warm_start:
      if restored:
        logging.info("%s holds checkpoints: resuming from them, "
                     "--init_checkpoint ignored.", restored)
      else:
        self._warm_start()
    if self._best:
      self._best.load()
    own_step = self.step
    if restored:
      logging.info("Resumed from %s at step %d.", restored, own_step)
    if self._chief_broadcast:
      changed = self._chief_broadcast.run()
      if changed:
        logging.warning(
            "This worker restored %s, at step %d; the chief's state differs "
            "in %d variable(s) (%s...) and is at step %d. Took the chief's "
            "state: do the workers see the same model_dir?",
            restored or "no checkpoint", own_step, len(changed),
            ", ".join(changed[:3]), self.step)
    if (restored or self.step != own_step) and self._after_restore:
      self._after_restore()
    self._last_checkpoint = restored
    self._saved_step = self.step if restored else None
    if self._checkpoints.is_survivor_state(restored):
      logging.info("That is the state a survivor of the previous group "
                   "kept when it lost a peer: no step is redone. Saving it "
                   "as a checkpoint.")
      self._save(self.step)
    self._checkpoints.remove_survivor_states()
    return restored

  def _finish_pending_export(self):
    """The best's export that a preemption left, or a kill cut short, is
    written now, from the restored weights when they are that best's."""
    pending = self._best.tracker.export_pending_at
    if pending is None:
      return
    if not self._best.exports:  # --noexport now: nothing to write.
      self._best.drop_pending_export()
      return
    if pending != self.step:
      logging.warning(
          "The export of the best eval (step %d) was never finished, and "
          "this run resumed at step %d: best_checkpoint/ holds that best; "
          "best_export/ is an older best's until the next best.",
          pending, self.step)
      self._best.drop_pending_export()
      return
    logging.info("Writing the export of the best eval (step %d), which "
                 "the previous run left unfinished.", pending)
    self._best.finish_export()

  def evaluate(self, step):
    """One exact eval pass; its agreed stop is acted on in _after_eval."""
    metrics, self._eval_sums = self._eval_pass.run(step)
    self._last_eval = (step, metrics)
    return metrics

  # The outer loop -----------------------------------------------------

  def _boundaries(self, step):
    options = self._options
    ends = [options.train_steps, _next_multiple(step, options.log_every)]
    for every in (options.eval_every, options.checkpoint_every,
                  options.check_replicas_every):
      if every:
        ends.append(_next_multiple(step, every))
    if options.profile_steps:
      ends.extend(s for s in options.profile_steps if s > step)
    if self._callbacks and self._runner.one_call_at_a_time:
      # Callbacks see every loop call.
      ends.append(_next_multiple(step, options.steps_per_loop))
    return min(ends)

  def train(self, until_step):
    """Trains from the current step to `until_step`; returns the metrics of
    the last log interval. Evaluates and checkpoints on the way."""
    options = self._options
    step = self.step
    iterator = self._train_iterator(step)
    logging.info("Training %s: step %d -> %d, global batch %d.",
                 self._describe, step, until_step, options.batch_size)
    meter = progress.Meter(time.perf_counter(), options.batch_size, self._metrics)
    first_step, loop_started = step, time.perf_counter()
    metrics = {}
    while step < until_step:
      self._profile(step)
      num_steps = min(self._boundaries(step), until_step) - step
      sums = self._runner.run_steps(iterator, num_steps,
                                    options.steps_per_loop, step)
      self._check_finite(sums, step)
      meter.add(sums)
      step += num_steps
      self._iterator_step = step
      if self._callbacks:
        self._callbacks.call_end(step, self._call_logs(sums))
        self._commit_survivor_state(step)
      if step % options.log_every == 0 or step == until_step:
        metrics = meter.read(time.perf_counter())
        self._log_progress(step, until_step, metrics, first_step,
                           loop_started)
        meter.reset(time.perf_counter())
      every = options.check_replicas_every
      if every and (step % every == 0 or step == until_step):
        self._replica_checker.check(step)
      if step < until_step:
        if (options.evaluates and options.eval_every
            and step % options.eval_every == 0):
          evaluated = self.evaluate(step)
          early_stop = self._after_eval(step, evaluated,
                                        metrics or self._call_logs(sums))
          meter.reset(time.perf_counter())
          if early_stop:
            break
        if options.checkpoint_every and step % options.checkpoint_every == 0:
          self._save_unless_saved()  # --best_metric may have saved it.
      if self._callbacks and self._callbacks.stop_training:
        logging.info("A callback set model.stop_training at step %d; "
                     "stopping after a checkpoint.", step)
        break
    self._profile(step)
    return metrics

  def _after_eval(self, step, metrics, train_logs):
    """The best and the callbacks take the eval, then the best's export
    is written; a SIGTERM agreed during the eval leaves that export to
    the resume (it could outlast the grace), saves and stops (out of the
    eval weights, and with this eval counted, as an uninterrupted run
    counts it). Returns whether to stop early."""
    early_stop = self._track_best(step, metrics)
    if self._callbacks:
      self._callbacks.eval_end(step, metrics, train_logs)
      self._commit_survivor_state(step)
    if self._best and not self._eval_sums.stop:
      self._best.finish_export()
    self._runner.stop_if_signalled(self._eval_sums)
    return early_stop

  def _commit_survivor_state(self, step):
    """With callbacks the runner does not commit: the state of `step` is
    the one the callbacks leave (a learning rate they set is in it)."""
    if self._survivor:
      self._survivor.commit(step)

  def _track_best(self, step, metrics):
    """After an eval: the best keeps this step's checkpoint (saved now if
    it is not yet) when the eval is the best so far; returns whether to
    stop early."""
    if not self._best:
      return False
    return self._best.update(step, metrics,
                             checkpoint_fn=self._saved_checkpoint,
                             export=False)

  def _saved_checkpoint(self):
    self._save_unless_saved()
    return self._last_checkpoint

  def _call_logs(self, sums):
    return {"loss": sums.loss_sum / max(sums.steps, 1),
            **self._metrics.results(sums.metric_states)}

  def _train_iterator(self, step):
    """The input iterator positioned at `step`, reused across train calls."""
    if self._iterator is None or self._iterator_step != step:
      self._iterator = self._runner.make_iterator(self._inputs.train_fn(
          step, self._options.seed if self._runner.same_data_everywhere
          else None))
      self._iterator_step = step
    return self._iterator

  def _profile(self, step):
    if not self._options.profile_steps:
      return
    start, end = self._options.profile_steps
    if start <= step < end:
      self._summaries.start_profile()
    elif step >= end:
      self._summaries.stop_profile()

  def _check_finite(self, sums, step):
    if sums.first_nonfinite is not None or not np.isfinite(sums.loss_sum):
      offset = (sums.first_nonfinite if sums.first_nonfinite is not None
                else sums.steps - 1)
      value = "nan" if np.isnan(sums.loss_sum) else "inf"
      raise NonFiniteLossError(
          f"loss became {value} at step {step + offset + 1}; "
          f"training stopped. Last good checkpoint kept: "
          f"{self._last_checkpoint or 'none'}.")

  def _save(self, step):
    self._last_checkpoint = self._checkpoints.save(step)
    self._saved_step = step
    logging.info("Saved checkpoint %s.", self._last_checkpoint)

  def _save_unless_saved(self):
    """The preemption save: none if this step is saved already (SIGTERM
    during the final eval)."""
    if self._saved_step != self.step:
      self._save(self.step)

  def _log_progress(self, step, total, metrics, first_step, loop_started):
    progress.log_line(step, total, metrics, first_step, loop_started)
    self._summaries.scalars("train", step, {
        **metrics, "learning_rate": self._learning_rate(step)})
