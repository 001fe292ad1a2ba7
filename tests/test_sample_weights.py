"""Per-example weights with Keras's meaning, and --class_weight: a user's
own (features, labels, sample_weight) datasets from a directory outside
the repository (tests/user_weighted.py), trained for real on default,
mirrored and parameter servers; weights and evals checked against runs
that must give the same numbers."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import artifacts
from conftest import ROOT
from conftest import user_project
from test_cli_errors import _assert_one_line_error
from test_trainer_features import _final_evals
from test_trainer_features import MIRRORED
from user_weighted import CLASS_WEIGHT_FLAG

COMMON = ["--train_steps=20", "--batch_size=32", "--steps_per_loop=10",
          "--log_every=10", "--eval_every=0", "--checkpoint_every=0",
          "--optimizer=sgd", "--noexport"]


@pytest.fixture
def outside(tmp_path):
  return user_project(tmp_path, "user_weighted.py", "weighted.py")


def _train(outside, name, task, *extra, check=True):
  """A run of weighted:TASK in `outside`, into outside/NAME."""
  proc = subprocess.run(
      [sys.executable, "-m", "tfdist.train", f"--task=weighted:{task}",
       f"--model_dir={outside / name}", *COMMON, *extra],
      cwd=outside, capture_output=True, text=True, timeout=300)
  if check:
    assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc


def _assert_same_weights(first, second):
  a, b = artifacts.model_weights(str(first)), artifacts.model_weights(
      str(second))
  kernels = [k for k in a if "_trainable_variables" in k]
  assert len(kernels) == 4 and set(a) == set(b)
  for key in kernels:
    np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("strategy", [[], MIRRORED], ids=["default",
                                                          "mirrored"])
def test_weights_of_two_equal_twice_the_learning_rate(outside, strategy):
  doubled = _train(outside, "doubled", "Doubled", *strategy,
                   "--learning_rate=0.05")
  plain = _train(outside, "plain", "Plain", *strategy,
                 "--learning_rate=0.1")
  _assert_same_weights(outside / "doubled", outside / "plain")
  # Eval weighs every example 2: the same accuracy, twice the loss (the
  # weighted sum divided by the number of examples, as Keras has it).
  weighted, unweighted = _final_evals(doubled.stdout), _final_evals(
      plain.stdout)
  assert weighted["accuracy"] == pytest.approx(unweighted["accuracy"],
                                               abs=1e-4)
  assert weighted["loss"] == pytest.approx(2 * unweighted["loss"],
                                           rel=1e-3)
  assert "(397 examples)" in doubled.stdout


def test_class_weight_equals_the_same_weights_in_the_data(outside):
  """--class_weight on integer labels weighs each example as a dataset
  with those weights does: on mirrored, with micro-batches too. Evals are
  unweighted in both."""
  extra = [*MIRRORED, "--grad_accum_steps=2", "--learning_rate=0.1"]
  in_data = _train(outside, "in_data", "ByClass", *extra)
  by_flag = _train(outside, "by_flag", "Plain", *extra,
                   f"--class_weight={CLASS_WEIGHT_FLAG}")
  _assert_same_weights(outside / "in_data", outside / "by_flag")
  assert _final_evals(in_data.stdout) == pytest.approx(
      _final_evals(by_flag.stdout), abs=1e-4)


def test_eval_weights_of_zero_leave_examples_out(outside):
  counted = _final_evals(_train(outside, "counted", "OddCounted",
                                "--train_steps=10").stdout)
  only = _final_evals(_train(outside, "only", "OddOnly",
                             "--train_steps=10").stdout)
  assert counted["accuracy"] == pytest.approx(only["accuracy"], abs=1e-4)
  # The loss divides by every real example (397), the odd ones only by
  # theirs.
  num_odd = 397 - sum(1 for y in _eval_labels() if y % 2 == 0)
  assert counted["loss"] == pytest.approx(only["loss"] * num_odd / 397,
                                          rel=1e-3)


def _eval_labels():
  from tfdist import digits  # pylint: disable=g-import-not-at-top
  return digits.load()[1][1400:]


@pytest.mark.parametrize("case,args,expected", [
    ("bad_weight_shape", ["--task=weighted:MatrixWeights"],
     "a train example's sample_weight must be one float"),
    ("bad_flag", ["--task=weighted:Plain", "--class_weight=3:x"],
     "--class_weight must be CLASS:WEIGHT pairs"),
    ("float_labels", ["--task=user_regression:RegressionTask",
                      "--class_weight=0:2"],
     "--class_weight needs one integer class label per example"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else "")
def test_bad_weights_are_one_line(outside, case, args, expected):
  shutil.copy(os.path.join(ROOT, "tests", "user_regression.py"), outside)
  model_dir = outside / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "tfdist.train", f"--model_dir={model_dir}",
       *COMMON, *args], cwd=outside, capture_output=True, text=True,
      timeout=300)
  _assert_one_line_error(proc, expected)
  assert not model_dir.exists() or not any(model_dir.iterdir()), case
