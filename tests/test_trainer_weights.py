"""What a Keras `fit` user expects of the weights a trainer starts from
and steps with: warm start and a Task's own loss. Real runs on default
and mirrored; weights checked against each other."""

import os

import numpy as np
import pytest

import artifacts
from conftest import run_cli
from test_trainer_features import _args
from test_trainer_features import _final_evals
from test_trainer_features import _with_path
from test_trainer_features import MIRRORED


# Warm start -----------------------------------------------------------------

_TRAINABLE = "optimizer/_trainable_variables/"


def _trainable(model_dir):
  """{index: array} of the model's trainable weights in the latest
  checkpoint (Keras 3 saves them once, under the optimizer)."""
  return {int(k[len(_TRAINABLE):].split("/")[0]): v
          for k, v in artifacts.model_weights(str(model_dir)).items()
          if k.startswith(_TRAINABLE)}


def _step_zero(model_dir, data_dir, *extra):
  """Trains one step with a learning rate of 0, so the checkpoint holds
  the weights the run started from."""
  return run_cli(*_args(model_dir, data_dir, "--mode=train",
                        "--train_steps=1", "--learning_rate=0", *extra))


@pytest.fixture(scope="module")
def warm_source(tmp_path_factory, data_dir):
  """A 30-step run both strategies warm-start from."""
  source = tmp_path_factory.mktemp("warm") / "source"
  run_cli(*_args(source, data_dir, "--mode=train", "--train_steps=30",
                 "--learning_rate=0.01"))
  return source


@pytest.fixture(scope="module")
def fresh_start(tmp_path_factory, data_dir):
  """The weights a run starts from without a warm start."""
  fresh = tmp_path_factory.mktemp("fresh") / "fresh"
  _step_zero(fresh, data_dir)
  return _trainable(fresh)


@pytest.mark.parametrize("strategy", [[], MIRRORED], ids=["default",
                                                          "mirrored"])
def test_warm_start_from_a_tfdist_checkpoint(tmp_path, data_dir, strategy,
                                             warm_source):
  source = warm_source
  warm = tmp_path / "warm"
  proc = _step_zero(warm, data_dir, *strategy, f"--init_checkpoint={source}")
  assert "Warm start: model weights from" in proc.stderr
  expected, started = _trainable(source), _trainable(warm)
  assert sorted(started) == sorted(expected)
  for index, value in expected.items():
    assert (started[index] == value).all(), index
  # A model_dir with checkpoints resumes, and says the flag is ignored.
  again = run_cli(*_args(warm, data_dir, *strategy, "--mode=train",
                         "--train_steps=2", f"--init_checkpoint={source}"))
  assert "--init_checkpoint ignored" in again.stderr


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_warm_start_from_keras_files_with_a_new_head(tmp_path, data_dir,
                                                     suffix, fresh_start):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist import models  # pylint: disable=g-import-not-at-top
  model = models.build("mlp", input_shape=(8, 8, 1), num_classes=10)
  model(tf.zeros([1, 8, 8, 1]))
  path = str(tmp_path / f"source{suffix}")
  if suffix == ".keras":
    model.save(path)
  else:
    model.save_weights(path)
  # The last layer's name ("logits"): the CLI's paths do not carry the
  # model's name as a prefix.
  head = model.trainable_variables[-1].path.split("/")[-2]
  warm = tmp_path / "warm"
  proc = _step_zero(warm, data_dir, f"--init_checkpoint={path}",
                    f"--init_checkpoint_skip=(^|/){head}/")
  assert "but 2 variable(s) matching" in proc.stderr, proc.stderr
  started, initial = _trainable(warm), fresh_start
  for index, variable in enumerate(model.trainable_variables):
    expected = (initial[index] if f"/{head}/" in f"/{variable.path}"
                else variable.numpy())
    assert (started[index] == expected).all(), variable.path
  assert not (started[0] == initial[0]).all()  # The body did change.


def test_warm_start_with_a_new_head_of_another_shape(tmp_path):
  """A tfdist checkpoint of a one-output model warm-starts a two-output
  one: the skipped head is never read (it keeps its initial values), the
  body comes from the source. Without the skip: one line, nothing
  written."""
  task = ["--task=tests.user_regression:TwoValueTask", "--mode=train",
          "--train_steps=1", "--learning_rate=0", "--noexport"]
  source = tmp_path / "source"
  run_cli(f"--model_dir={source}", "--mode=train", "--train_steps=20",
          "--task=tests.user_regression:RegressionTask", "--noexport")
  fresh, warm = tmp_path / "fresh", tmp_path / "warm"
  run_cli(f"--model_dir={fresh}", *task)
  proc = run_cli(f"--model_dir={warm}", *task, f"--init_checkpoint={source}",
                 "--init_checkpoint_skip=(^|/)value/")
  assert "but 2 variable(s) matching" in proc.stderr, proc.stderr
  expected, started, initial = (_trainable(d) for d in (source, warm, fresh))
  heads = [i for i, v in initial.items() if v.shape[-1:] == (2,)]
  assert len(heads) == 2 and len(started) == len(expected) == 5
  for index, value in started.items():
    wanted = initial[index] if index in heads else expected[index]
    assert (value == wanted).all(), index
  assert not (started[0] == initial[0]).all()  # The body did change.
  refused = run_cli(f"--model_dir={tmp_path / 'refused'}", *task,
                    f"--init_checkpoint={source}", check=False)
  assert refused.returncode == 2 and "Traceback" not in refused.stderr
  assert ("does not fit this model (another shape: " in refused.stderr
          and "--init_checkpoint_skip=REGEX" in refused.stderr)
  assert not (tmp_path / "refused" / "checkpoint").exists()


def test_warm_start_from_nothing_is_one_line(tmp_path, data_dir):
  proc = run_cli(*_args(tmp_path / "run", data_dir,
                        f"--init_checkpoint={tmp_path}/missing"),
                 check=False)
  assert proc.returncode != 0
  assert "tfdist: error: --init_checkpoint=" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(tmp_path / "run" / "checkpoint")


def _max_relative_difference(a, b):
  import numpy as np  # pylint: disable=g-import-not-at-top
  return max(float(np.max(np.abs(a[k] - b[k]) / (np.abs(b[k]) + 1e-6)))
             for k in b if a[k].dtype.kind == "f")


# A Task's own loss -------------------------------------------------------

_LOSS_TASKS = '''
import keras
import numpy as np
import tensorflow as tf
import tfdist
from tfdist import digits


def _split():
  x, y = digits.load()
  x = x.reshape(len(x), -1)
  x = (x / 16.0).astype("float32")
  y = y.astype("int32")
  return (tf.data.Dataset.from_tensor_slices((x[:1400], y[:1400])),
          tf.data.Dataset.from_tensor_slices((x[1400:], y[1400:])))


class Plain(tfdist.Task):
  def build_model(self):
    return keras.Sequential([keras.Input((64,)),
                             keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10)])

  def datasets(self):
    return _split()


class OwnLoss(Plain):
  """The default loss, written by hand: the same weights."""

  def compute_loss(self, model, features, labels, training):
    logits = model(features, training=training)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
    return loss, logits


class Distill(Plain):
  """A frozen teacher's soft labels mixed in with weight ALPHA."""

  ALPHA = 0.5

  def build_model(self):
    # Built with the student, under the strategy; not part of the model,
    # so it is neither trained nor saved.
    student = super().build_model()  # First: the same init as Plain.
    self.teacher = keras.Sequential([keras.Input((64,)),
                                     keras.layers.Dense(10)])
    self.teacher.trainable = False
    return student

  def compute_loss(self, model, features, labels, training):
    logits = model(features, training=training)
    soft = tf.nn.softmax(self.teacher(features, training=False))
    hard = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
    distilled = tf.nn.softmax_cross_entropy_with_logits(soft, logits)
    return (1 - self.ALPHA) * hard + self.ALPHA * distilled  # Loss only.


class NoTeacher(Distill):
  ALPHA = 0.0
'''


@pytest.fixture(scope="module")
def loss_tasks(tmp_path_factory):
  outside = tmp_path_factory.mktemp("user")
  (outside / "losstasks.py").write_text(_LOSS_TASKS)
  return outside


@pytest.fixture(scope="module")
def plain_weights(tmp_path_factory, data_dir, loss_tasks):
  """The Plain task's weights on one device, which both strategies'
  own losses must give."""
  model_dir = tmp_path_factory.mktemp("plain") / "plain"
  _task_run(model_dir, data_dir, loss_tasks, "Plain")
  return artifacts.model_weights(str(model_dir))


def _task_run(model_dir, data_dir, outside, task, *extra):
  return run_cli(*_args(model_dir, data_dir, f"--task=losstasks:{task}",
                        "--mode=train", "--train_steps=40", *extra),
                 env=_with_path(outside))


@pytest.mark.parametrize("strategy", [[], MIRRORED], ids=["default",
                                                          "mirrored"])
def test_a_tasks_own_loss(tmp_path, data_dir, loss_tasks, strategy,
                         plain_weights):
  plain = plain_weights
  for task in ("OwnLoss", "NoTeacher"):
    _task_run(tmp_path / task, data_dir, loss_tasks, task, *strategy)
    artifacts.assert_weights_close(
        artifacts.model_weights(str(tmp_path / task)), plain, rtol=1e-5)
  # The teacher's soft labels do change the training.
  _task_run(tmp_path / "distill", data_dir, loss_tasks, "Distill",
            *strategy)
  assert _max_relative_difference(
      artifacts.model_weights(str(tmp_path / "distill")), plain) > 1e-3


# A moving average of the weights --------------------------------------------

def _ema_run(model_dir, data_dir, *extra):
  return run_cli(*_args(model_dir, data_dir, "--optimizer=sgd",
                        "--learning_rate=0.5", "--steps_per_loop=1",
                        "--log_every=1", "--checkpoint_every=1",
                        "--keep_checkpoints=5", "--export", *extra))


@pytest.fixture(scope="module")
def plain_ema_reference(tmp_path_factory, data_dir):
  """The same 2 steps without an average: (the raw weights at step 2,
  their final evals)."""
  plain = tmp_path_factory.mktemp("noema") / "plain"
  _ema_run(plain, data_dir, "--train_steps=2", "--eval_every=1")
  raw = artifacts.variables_by_name(str(plain / "ckpt-2"))
  evals = _final_evals(run_cli(*_args(plain, data_dir,
                                      "--mode=eval")).stdout)
  return raw, evals


@pytest.mark.parametrize("strategy", [[], MIRRORED], ids=["default",
                                                          "mirrored"])
def test_ema_is_kept_saved_and_used_for_eval_and_export(tmp_path, data_dir,
                                                        strategy,
                                                        plain_ema_reference):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  averaged = tmp_path / "ema"
  ema = _ema_run(averaged, data_dir, *strategy, "--train_steps=2",
                 "--eval_every=1", "--ema_decay=0.25")
  first = artifacts.variables_by_name(str(averaged / "ckpt-1"))
  second = artifacts.variables_by_name(str(averaged / "ckpt-2"))
  names = [n for n in second if _average_of(n) in second]
  assert len(names) == 6, sorted(second)  # 3 kernels, 3 biases.
  for name in names:
    # The first step's average is its weights; then 0.25 old + 0.75 new.
    np.testing.assert_allclose(
        second[_average_of(name)],
        0.25 * first[name] + 0.75 * second[name], rtol=1e-5, atol=1e-7)
  # Training steps with the raw weights: the same as without the average
  # (the swap for the eval at step 1 put them back).
  raw, plain_evals = plain_ema_reference
  for name in names:
    np.testing.assert_allclose(second[name], raw[name], rtol=1e-5,
                               atol=1e-7)
  # Eval and the export use the average, not the raw weights.
  assert _final_evals(ema.stdout) != pytest.approx(plain_evals,
                                                      abs=1e-4)
  again = run_cli(*_args(averaged, data_dir, *strategy, "--mode=eval",
                         "--ema_decay=0.25"))
  assert _final_evals(again.stdout) == pytest.approx(
      _final_evals(ema.stdout), abs=1e-4)
  inputs = tf.random.stateless_uniform([4, 8, 8, 1], (3, 4))
  exported = tf.saved_model.load(str(averaged / "export"))
  served = exported.signatures["serving_default"](
      images=inputs)["logits"].numpy()
  expected = _mlp_logits(second, names, inputs.numpy())
  np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)


def _average_of(name):
  """The name Keras gives the moving average of variable `name` (SGD)."""
  return f"sgd/{name.replace('/', '_')}_average"


def _mlp_logits(variables, names, images):
  """The zoo mlp's logits with the checkpoint's averaged weights."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  average = {n: variables[_average_of(n)] for n in names}
  kernels = sorted(n for n in names if n.endswith("kernel"))
  x = images.reshape(len(images), -1)
  for index, kernel in enumerate(kernels):
    x = x @ average[kernel] + average[kernel.replace("kernel", "bias")]
    if index < len(kernels) - 1:
      x = np.maximum(x, 0.0)
  return x


_SIGTERM_MODULE = '''
import os

import numpy as np
import signal
import keras


class SigtermAt(keras.callbacks.Callback):
  def __init__(self, step):
    super().__init__()
    self.step = step

  def on_train_batch_end(self, batch, logs=None):
    if batch == self.step:  # Carried by the next loop call: the eval's.
      os.kill(os.getpid(), signal.SIGTERM)


def at_10():
  return [SigtermAt(10)]
'''


def test_a_preemption_during_an_eval_saves_the_trained_weights(
    tmp_path, data_dir):
  """SIGTERM agreed by the eval at step 10 of an --ema_decay run: the
  checkpoint holds the trained weights, not their average (the eval's)."""
  outside = tmp_path / "user"
  outside.mkdir()
  (outside / "preempt.py").write_text(_SIGTERM_MODULE)
  flags = ["--train_steps=20", "--eval_every=10", "--ema_decay=0.5",
           "--learning_rate=0.05"]
  run_cli(*_args(tmp_path / "plain", data_dir, *flags,
                 "--train_steps=10"))
  proc = run_cli(*_args(tmp_path / "preempted", data_dir, *flags,
                        "--callbacks=preempt:at_10"),
                 env=_with_path(outside), check=False)
  assert proc.returncode == 42, proc.stderr[-3000:]
  assert "checkpoint saved at step 10" in proc.stderr
  assert artifacts.checkpoint_step(str(tmp_path / "preempted")) == 10
  trained = _trainable(tmp_path / "plain")
  saved = _trainable(tmp_path / "preempted")
  for index, weights in trained.items():
    np.testing.assert_allclose(saved[index], weights, rtol=1e-6,
                               atol=1e-7, err_msg=str(index))
