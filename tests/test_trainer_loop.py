"""The outer loop alone, in process, with a fake runner, store and
summaries: cadence, NaN reporting, resume, metrics."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import compiled_loops
from tfdist import loop_wire
from tfdist import preemption
from tfdist import data
from tfdist import evaluation
from tfdist import trainer as trainer_lib
from tfdist.errors import NonFiniteLossError


class FakeRunner:
  """Counts steps like a runner; losses and metric states are scripted."""

  same_data_everywhere = True

  def __init__(self, global_step, *, bad_step=None):
    self.calls, self.evals = [], []
    self._global_step = global_step
    self._bad_step = bad_step

  def preemption_watched(self, *, save_fn, step_fn, grace_seconds):
    del save_fn, step_fn, grace_seconds
    return contextlib.nullcontext(preemption.Unwatched())

  def stop_if_signalled(self, sums):
    del sums

  def make_iterator(self, input_fn):
    return input_fn

  def run_steps(self, iterator, num_steps, steps_per_call, first_step):
    del iterator, steps_per_call
    start = int(self._global_step.numpy())
    assert first_step == start, (first_step, start)
    self.calls.append((start, num_steps))
    first = None
    if self._bad_step is not None and start < self._bad_step <= (
        start + num_steps):
      first = self._bad_step - start - 1
    self._global_step.assign_add(num_steps)
    # Metric state of keras.metrics.Mean: (total, count).
    return loop_wire.LoopSums(
        steps=num_steps, loss_sum=float("nan") if first is not None
        else 2.0 * num_steps, first_nonfinite=first,
        metric_states=[[np.float32(3.0 * num_steps),
                        np.float32(num_steps)]])

  def evaluate(self, input_fn, num_steps):
    del input_fn
    self.evals.append((int(self._global_step.numpy()), num_steps))
    return loop_wire.LoopSums(steps=num_steps, loss_sum=8.0,
                                   examples=16.0,
                                   metric_states=[[np.float32(4.0),
                                                   np.float32(16.0)]])


class FakeStore:

  def __init__(self, global_step, restore_to=None):
    self.saved = []
    self._global_step = global_step
    self._restore_to = restore_to

  def restore(self):
    if self._restore_to is None:
      return None
    self._global_step.assign(self._restore_to)
    return f"ckpt-{self._restore_to}"

  def save(self, step):
    self.saved.append(step)
    return f"ckpt-{step}"

  @staticmethod
  def is_survivor_state(path):
    del path
    return False

  def remove_survivor_states(self):
    pass


class FakeSummaries:

  def __init__(self):
    self.scalars_written = []

  def scalars(self, kind, step, values):
    self.scalars_written.append((kind, step, dict(values)))

  def hparams(self, values):
    del values

  def start_profile(self):
    pass

  def stop_profile(self):
    pass

  def close(self):
    pass


class FakeLoops:
  metrics = compiled_loops.Metrics([keras.metrics.Mean(name="score")])


def _trainer(*, restore_to=None, bad_step=None, **options):
  global_step = tf.Variable(0, dtype=tf.int64)
  inputs = data.Inputs(name="numbers", train_fn=lambda step, seed: None,
                       eval_fn=lambda: None, eval_steps=2, sample=None,
                       features_spec=None)
  runner = FakeRunner(global_step, bad_step=bad_step)
  store = FakeStore(global_step, restore_to)
  summaries = FakeSummaries()
  defaults = dict(train_steps=100, batch_size=16, steps_per_loop=10,
                  log_every=30, eval_every=50, checkpoint_every=40)
  trainer = trainer_lib.Trainer(
      options=trainer_lib.LoopOptions(**{**defaults, **options}),
      model=None, optimizer=None, global_step=global_step, runner=runner,
      loops=FakeLoops(), checkpoints=store, summaries=summaries,
      inputs=inputs, describe="fake", learning_rate=lambda step: 0.5,
      eval_pass=evaluation.EvalPass(runner=runner, inputs=inputs,
                                    metrics=FakeLoops.metrics,
                                    summaries=summaries))
  return trainer, runner, store, summaries


def test_cadence_of_logs_evals_and_checkpoints():
  trainer, runner, store, summaries = _trainer()
  result = trainer.run()
  ends = [start + n for start, n in runner.calls]
  assert ends == [30, 40, 50, 60, 80, 90, 100]
  assert store.saved == [40, 80, 100]
  assert [step for step, _ in runner.evals] == [50, 100]
  # Eval: 2 batches of 16 for 32 examples; exact means from summed state.
  assert runner.evals[0][1] == 2
  assert result.eval_metrics == {"loss": 0.5, "score": 0.25,
                                 "examples": 16}
  logged = [(step, values) for kind, step, values in
            summaries.scalars_written if kind == "train"]
  assert [step for step, _ in logged] == [30, 60, 90, 100]
  assert logged[0][1]["loss"] == 2.0 and logged[0][1]["score"] == 3.0
  assert logged[0][1]["learning_rate"] == 0.5


def test_non_finite_loss_names_the_step_and_saves_nothing_after():
  trainer, _, store, _ = _trainer(bad_step=47)
  with pytest.raises(NonFiniteLossError, match="loss became nan at step 47"):
    trainer.run()
  assert store.saved == [40]


def test_resume_starts_at_the_restored_step():
  trainer, runner, store, _ = _trainer(restore_to=60)
  result = trainer.run()
  assert runner.calls[0][0] == 60 and result.step == 100
  assert result.checkpoint == "ckpt-100" and store.saved == [80, 100]
