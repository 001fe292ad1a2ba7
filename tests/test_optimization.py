"""Optimization options: learning-rate schedules (TensorBoard against the
formula, across a resume), clipping after the all-reduce, weight decay."""

import math

import numpy as np
import pytest

import artifacts
from conftest import run_cli
from tfdist import optimizers

PEAK, END, WARMUP, DECAY = 1e-2, 1e-4, 20, 60


def _cosine(step):
  """The documented cosine schedule, written out independently."""
  if step < WARMUP:
    return PEAK * step / WARMUP
  progress = min(step - WARMUP, DECAY) / DECAY
  return END + (PEAK - END) * 0.5 * (1 + math.cos(math.pi * progress))


def _linear(step):
  if step < WARMUP:
    return PEAK * step / WARMUP
  return PEAK + (END - PEAK) * min(step - WARMUP, DECAY) / DECAY


def _step(step):
  if step < WARMUP:
    return PEAK * step / WARMUP
  return PEAK * 0.1 ** ((step - WARMUP) // DECAY)


@pytest.mark.parametrize("name,formula", [("cosine", _cosine),
                                          ("linear", _linear),
                                          ("step", _step)])
def test_the_optimizer_schedule_follows_the_formula(name, formula):
  kwargs = dict(schedule=name, learning_rate=PEAK, warmup_steps=WARMUP,
                decay_steps=DECAY, end_learning_rate=END)
  keras_schedule = optimizers._keras_schedule(kwargs)  # pylint: disable=protected-access
  for step in [0, 1, 10, 19, 20, 21, 50, 79, 80, 81, 140, 200]:
    expected = formula(step)
    assert optimizers.scheduled_rate(step, **kwargs) == pytest.approx(
        expected, rel=1e-9, abs=1e-12)
    assert float(keras_schedule(step)) == pytest.approx(expected, rel=1e-5,
                                                        abs=1e-9)


def test_tensorboard_learning_rate_is_the_formula_across_a_resume(tmp_path,
                                                                  data_dir):
  model_dir = str(tmp_path / "run")
  args = ["--lr_schedule=cosine", f"--learning_rate={PEAK}",
          f"--warmup_steps={WARMUP}", f"--decay_steps={DECAY}",
          f"--end_learning_rate={END}", "--log_every=10",
          "--steps_per_loop=10", "--eval_every=0", "--export=false",
          f"--data_dir={data_dir}", f"--model_dir={model_dir}"]
  run_cli(*args, "--train_steps=60", "--checkpoint_every=30")
  run_cli(*args, "--train_steps=100")
  logged = artifacts.scalars(f"{model_dir}/train", "learning_rate")
  assert [s for s, _ in logged] == list(range(10, 101, 10))
  for step, value in logged:
    assert value == pytest.approx(_cosine(step), rel=1e-5), step
  # The optimizer's own step, which drives its schedule, resumed too.
  weights = artifacts.model_weights(model_dir)
  assert int(weights["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 100


def _kernels(model_dir):
  weights = artifacts.model_weights(model_dir)
  return {k: v for k, v in weights.items()
          if k.startswith("optimizer/_trainable_variables/")}


def test_clipping_after_the_all_reduce_and_weight_decay(tmp_path, data_dir):
  common = ["--train_steps=1", "--steps_per_loop=1", "--log_every=1",
            "--eval_every=0", "--export=false", "--optimizer=sgd",
            f"--data_dir={data_dir}"]

  def run(name, *extra):
    run_cli(*common, *extra, f"--model_dir={tmp_path / name}")
    return _kernels(str(tmp_path / name))

  # A warmup makes step 0's rate 0: that checkpoint holds the initial
  # weights.
  initial = run("initial", "--learning_rate=1", "--warmup_steps=5")
  clip = 0.01
  clipped = run("clipped", "--learning_rate=1", f"--clip_norm={clip}")
  moved = math.sqrt(sum(np.sum((clipped[k] - initial[k]) ** 2)
                        for k in initial))
  assert moved == pytest.approx(clip, rel=1e-4)
  # Two replicas clip the summed gradient identically: same weights.
  mirrored = run("mirrored", "--learning_rate=1", f"--clip_norm={clip}",
                 "--strategy=mirrored", "--num_cpu_devices=2",
                 "--check_replicas_every=1")
  artifacts.assert_weights_close(mirrored, clipped, rtol=1e-5)
  # Decoupled weight decay: w <- w - lr * wd * w, besides the gradient step.
  plain = run("plain", "--learning_rate=0.1")
  decayed = run("decayed", "--learning_rate=0.1", "--weight_decay=0.5")
  for key in initial:
    np.testing.assert_allclose(decayed[key] - plain[key],
                               -0.1 * 0.5 * initial[key], atol=1e-6,
                               err_msg=key)
