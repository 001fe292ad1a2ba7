"""Evaluation apart from training: the exact eval pass, the best eval's
keeper, and the sidecar evaluator (--mode=eval, --mode=continuous_eval and
a job's evaluator task), which evaluates the checkpoints a training run
writes and trains nothing."""

import contextlib
import time

from absl import logging

from tfdist.trainer import RunResult


class EvalPass:
  """One exact pass over the eval split (or eval_steps batches), in the
  eval weights (the moving average with --ema_decay), logged and written
  to the eval summaries."""

  def __init__(self, *, runner, inputs, metrics, summaries,
               eval_weights=None):
    self._runner = runner
    self._inputs = inputs  # A tfdist.data.Inputs.
    self._metrics = metrics
    self._summaries = summaries
    self._eval_weights = eval_weights or contextlib.nullcontext

  def run(self, step):
    """Returns (metrics, the pass's LoopSums, whose `stop` is the SIGTERM
    agreed during it)."""
    with self._eval_weights():
      sums = self._runner.evaluate(self._inputs.eval_fn(),
                                   self._inputs.eval_steps)
    examples = max(sums.examples, 1.0)
    metrics = {"loss": sums.loss_sum / examples,
               **self._metrics.results(sums.metric_states),
               "examples": int(sums.examples)}
    names = [k for k in metrics if k not in ("loss", "examples")] + ["loss"]
    shown = "  ".join(f"{k} {metrics[k]:.4f}" for k in names)
    logging.info("eval  step %d: %s  (%d examples)", step, shown,
                 metrics["examples"])
    self._summaries.scalars("eval", step, {k: v for k, v in metrics.items()
                                           if k != "examples"})
    return metrics, sums


class BestKeeper:
  """After an eval: keeps the checkpoint and the export of the best eval
  so far (a tfdist.best.BestTracker decides), and says when to stop."""

  def __init__(self, *, tracker, checkpoints, export_fn=None):
    self.tracker = tracker
    self._checkpoints = checkpoints
    self._export_fn = export_fn

  def load(self):
    self.tracker.load(self._checkpoints.read_best_state(mend=True))

  @property
  def exports(self):
    """Whether the best is exported (--export)."""
    return self._export_fn is not None

  def update(self, step, metrics, checkpoint_fn, *, export=True):
    """`checkpoint_fn()` gives this step's checkpoint, called only when
    the eval is the best (a training run saves it then). The best's
    export is marked pending in best.json, with the best, before it is
    written: a kill during it leaves the mark, which a training run's
    resume acts on (a sidecar's says so; the next best is exported).
    `export=False`: the caller writes it later with finish_export (the
    trainer, after the callbacks, unless a preemption was agreed in the
    eval: the export could outlast its grace). Returns whether to stop
    early."""
    best = self.tracker
    decision = best.update(step, metrics)
    if decision.improved:
      if self._export_fn:
        best.export_pending_step.assign(step)
      kept = self._checkpoints.keep_best(checkpoint_fn(), best.state())
      logging.info("Best %s so far: %.4f at step %d%s.", best.metric,
                   metrics[best.metric], step,
                   f", kept in {kept}" if kept else "")
      if export:
        self.finish_export()
    else:
      self._checkpoints.update_best_state(best.state())
    if decision.stop:
      logging.info("Early stopping at step %d: no better %s in %d evals "
                   "(best %.4f at step %d).", step, best.metric,
                   best.patience, float(best.best_value.numpy()),
                   int(best.best_step.numpy()))
    return decision.stop

  def finish_export(self):
    """Writes the best's export if it is pending, then clears the mark.
    Every worker calls it alike (the mark is in the state the chief
    sends): saving may need collectives."""
    if self.tracker.export_pending_at is None:
      return
    if self._export_fn:
      self._export_fn(best=True)
    self.drop_pending_export()

  def drop_pending_export(self):
    self.tracker.export_pending_step.assign(-1)
    self._checkpoints.update_best_state(self.tracker.state())


class SidecarEvaluator:
  """Evaluates checkpoints of a training run in model_dir."""

  def __init__(self, *, train_steps, global_step, checkpoints, eval_pass,
               summaries, keeper=None):
    self._train_steps = train_steps
    self.global_step = global_step
    self._checkpoints = checkpoints
    self._eval_pass = eval_pass
    self._summaries = summaries
    self._keeper = keeper  # A BestKeeper, or None.

  @property
  def step(self):
    return int(self.global_step.numpy())

  def evaluate_once(self, checkpoint=None):
    """--mode=eval: restores `checkpoint` (default: the latest in
    model_dir), evaluates it once and writes its eval events."""
    started = time.perf_counter()
    path = self._checkpoints.restore_for_eval(checkpoint)
    try:
      metrics, _ = self._eval_pass.run(self.step)
    finally:
      self._summaries.close()
    return RunResult(
        step=self.step, eval_metrics=metrics, train_metrics={},
        checkpoint=path, export_dir=None,
        seconds=time.perf_counter() - started)

  def evaluate_checkpoints(self, *, timeout_seconds):
    """Evaluates each new checkpoint in model_dir until one at
    train_steps; returns the last metrics, or None on timeout."""
    metrics = None
    if self._keeper:
      self._keeper.load()
      self._drop_pending_export()
    for path in self._checkpoints.new_checkpoints(timeout_seconds):
      metrics, _ = self._eval_pass.run(self.step)
      if self._keeper and self._keeper.update(
          self.step, metrics, checkpoint_fn=lambda p=path: p):
        logging.info("The training run stops at its next checkpoint "
                     "(best.json tells its chief).")
        break
      if self.step >= self._train_steps:
        break
    self._summaries.close()
    return metrics

  def _drop_pending_export(self):
    """A sidecar killed during a best's export: that export is not
    written again (its weights would have to be restored first); the
    next best's is. Said in one line."""
    pending = self._keeper.tracker.export_pending_at
    if pending is not None and self._keeper.exports:
      logging.warning("The export of the best eval (step %d) was cut short "
                      "in an earlier run: best_checkpoint/ holds that best, "
                      "best_export/ is written again at the next best.",
                      pending)
    if pending is not None:
      self._keeper.drop_pending_export()
