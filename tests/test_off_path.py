"""Off the tested path (issue 21): what a new user meets first. A fresh
data_dir, a user's module outside the repository, in-memory data on every
strategy and launcher, a non-local model_dir, a squeezed regression head.

No test here shares the session's prepared data_dir.
"""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import artifacts
from conftest import ROOT
from conftest import user_project
from test_user_task import COMMON
from test_user_task import _run
from test_user_task import outside  # noqa: F401  (a fixture)


def test_a_first_run_trains_the_same_weights_as_the_next(tmp_path):
  """The run that prepares digits in a fresh data_dir, the run after it,
  and mirrored over 4 CPUs in another fresh data_dir: the same weights."""
  args = ["--model=mlp", "--dataset=digits", "--batch_size=64",
          "--train_steps=40", "--seed=7", "--eval_every=1000"]
  runs = {}
  for name, data_dir, extra in [
      ("first", "fresh", []), ("second", "fresh", []),
      ("mirrored", "fresh4", ["--strategy=mirrored",
                              "--num_cpu_devices=4"])]:
    model_dir = str(tmp_path / name)
    proc = _run(ROOT, [
        *args, *extra, f"--data_dir={tmp_path / data_dir}",
        f"--model_dir={model_dir}"])
    runs[name] = (artifacts.model_weights(model_dir),
                  re.search(r"Finished.*", proc.stdout).group(0))
  first, second = runs["first"], runs["second"]
  artifacts.assert_weights_close(first[0], second[0], rtol=0)
  assert first[1].split(" in ")[1].split(": ")[1] == \
      second[1].split(" in ")[1].split(": ")[1]
  artifacts.assert_weights_close(runs["mirrored"][0], first[0], rtol=1e-5)


_USER_FORMS = {
    # A compiled Keras model fed from in-memory numpy arrays.
    "compiled_model": ["--model=mymod:build", "--dataset=mymod:data"],
    # A tfdist.Task whose datasets() are in-memory arrays too.
    "task": ["--task=mymod:RegressionTask"],
}
_STRATEGIES = {
    "default": ("tfdist.train", ["--strategy=default"]),
    "mirrored": ("tfdist.train", ["--strategy=mirrored",
                                  "--num_cpu_devices=2"]),
    "mwms": ("tfdist.launch.local", ["--workers=2", "--",
                                     "--strategy=multi_worker_mirrored"]),
    "ps": ("tfdist.launch.local", ["--chief", "--workers=2", "--ps=1",
                                   "--", "--strategy=parameter_server"]),
}


def _check_default_run(form, stdout, model_dir):
  if form == "task":
    # The embedding really trained (its table is among the checkpoint's).
    assert len(artifacts.model_weights(model_dir)) >= 8
    return
  # A compiled model brings its own loss (mse) and metric (mae), not
  # classification's: regression targets are floats, which sparse
  # cross-entropy would reject.
  assert "eval mae " in stdout
  assert {"loss", "mae"} <= artifacts.summary_tags(
      os.path.join(model_dir, "eval"))
  loss = float(stdout.split("eval loss ")[1].split()[0])
  assert 0 < loss < 50


def _run_form(form, strategy, root):
  """`form` on `strategy` from a module outside the repo with a fresh
  data_dir; (its stdout and stderr, model_dir, final eval loss)."""
  module, launcher_args = _STRATEGIES[strategy]
  outside_dir = user_project(root, "user_regression.py", "mymod.py")
  model_dir = str(root / "run")
  args = [*_USER_FORMS[form], *COMMON, "--train_steps=60",
          f"--data_dir={root / 'fresh'}", f"--model_dir={model_dir}"]
  proc = _run(outside_dir, [*launcher_args, *args], module)
  assert artifacts.checkpoint_step(model_dir) == 60
  loss = float(re.search(r"Finished at step 60/60 .*eval loss ([0-9.]+)",
                         proc.stdout).group(1))
  return proc.stdout + proc.stderr, model_dir, loss


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
  """form -> (weights, loss) of its default run, made once, checked."""
  runs = {}

  def run(form):
    if form not in runs:
      stdout, model_dir, loss = _run_form(
          form, "default", tmp_path_factory.mktemp(f"default-{form}"))
      _check_default_run(form, stdout, model_dir)
      runs[form] = (artifacts.model_weights(model_dir), loss)
    return runs[form]
  return run


@pytest.mark.parametrize("strategy", list(_STRATEGIES))
@pytest.mark.parametrize("form", list(_USER_FORMS))
def test_user_model_on_every_strategy_from_a_fresh_data_dir(
    tmp_path, form, strategy, default_runs):
  """Synchronous strategies give the default run's weights (rtol 1e-5);
  asynchronous PS trains to the default run's loss, within 2x."""
  expected, default_loss = default_runs(form)
  if strategy == "default":
    return  # default_runs checked it.
  stdout, model_dir, loss = _run_form(form, strategy, tmp_path)
  assert f"Strategy: {_strategy_logged(strategy)}" in stdout, stdout[-3000:]
  if strategy == "ps":
    assert "chief:0 | " in stdout and "worker:1 | " in stdout
    assert loss < 2 * default_loss + 0.05, (loss, default_loss)
  else:
    artifacts.assert_weights_close(artifacts.model_weights(model_dir),
                                   expected, rtol=1e-5)


def _strategy_logged(strategy):
  return {"mwms": "multi_worker_mirrored", "ps": "parameter_server"}.get(
      strategy, strategy)


@pytest.mark.serial  # Owns Ray's daemons.
def test_user_model_on_the_ray_launcher(outside, tmp_path, netns):
  """launch.ray with in-memory user data, MWMS and PS: the MWMS weights
  equal those of a default run."""
  pytest.importorskip("ray")
  args = ["--model=mymod:build", "--dataset=mymod:data", *COMMON,
          f"--data_dir={tmp_path / 'fresh'}"]
  _run(outside, [*args, f"--model_dir={tmp_path / 'd'}"])
  _run(outside,
       ["--workers=2", "--", *args, f"--model_dir={tmp_path / 'mwms'}"],
       "tfdist.launch.ray", prefix=netns)
  artifacts.assert_weights_close(
      artifacts.model_weights(str(tmp_path / "mwms")),
      artifacts.model_weights(str(tmp_path / "d")), rtol=1e-5)
  proc = _run(outside,
              ["--chief", "--workers=1", "--ps=1", "--",
               "--strategy=parameter_server", *args,
               f"--model_dir={tmp_path / 'ps'}"], "tfdist.launch.ray",
              prefix=netns)
  assert "chief:0 | Finished at step 20/20" in proc.stdout
  assert artifacts.checkpoint_step(str(tmp_path / "ps")) == 20


SQUEEZED = '''
import keras, numpy as np, tensorflow as tf

def build():
  inputs = keras.Input((3,))
  hidden = keras.layers.Dense(8, activation="relu")(inputs)
  value = keras.layers.Reshape(())(keras.layers.Dense(1)(hidden))
  model = keras.Model(inputs, value)  # Output shape [batch].
  model.compile(loss="mse", metrics=["mae"])
  return model

def arrays():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(512, 3)).astype("float32")
  return x, (x @ np.array([1.0, -2.0, 0.5], "float32")).astype("float32")

def data():
  x, y = arrays()  # Labels of shape [batch] too.
  return (tf.data.Dataset.from_tensor_slices((x[:448], y[:448])),
          tf.data.Dataset.from_tensor_slices((x[448:], y[448:])))
'''


def test_a_squeezed_regression_head_trains_as_keras_fit(tmp_path):
  """Rank-1 outputs and labels with loss="mse": the eval loss and mae are
  the mean over the eval examples of the export's own predictions."""
  (tmp_path / "squeezed.py").write_text(SQUEEZED)
  model_dir = tmp_path / "run"
  proc = _run(tmp_path, [
      "--model=squeezed:build", "--dataset=squeezed:data",
      "--train_steps=200", "--learning_rate=0.01", "--batch_size=32",
      f"--data_dir={tmp_path / 'fresh'}", f"--model_dir={model_dir}"])
  line = re.search(r"Finished at step 200/200.*", proc.stdout).group(0)
  script = (
      "import sys, numpy as np, tensorflow as tf; sys.path.insert(0, '.');"
      "import squeezed; x, y = squeezed.arrays();"
      f"m = tf.saved_model.load({str(model_dir / 'export')!r});"
      "p = m.signatures['serving_default'](features=tf.constant(x[448:]))"
      "['outputs'].numpy(); print(p.shape, np.mean((p - y[448:]) ** 2),"
      " np.mean(np.abs(p - y[448:])))")
  check = subprocess.run([sys.executable, "-c", script], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
  assert check.returncode == 0, check.stderr[-2000:]
  shape, mse, mae = re.search(r"^\((\d+),\) (\S+) (\S+)$", check.stdout,
                              re.M).groups()
  assert shape == "64"
  assert f"eval mae {float(mae):.4f}" in line, (line, mae)
  assert f"eval loss {float(mse):.4f}" in line, (line, mse)
  assert float(mse) < 0.2  # The target's variance is about 5.


def test_a_remote_model_dir_for_a_whole_run(tmp_path, monkeypatch):
  """ram:// (in-memory, through tf.io.gfile like gs:// and s3://), in
  this process: train, checkpoint, resume, eval, export, load the export.
  Nothing is written to the local working directory."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  from tfdist import digits  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  model_dir = "ram://tfdist-test/run"
  data_dir = str(tmp_path / "fresh")
  common = dict(model="mlp", dataset="digits", data_dir=data_dir,
                model_dir=model_dir, eval_every=0, checkpoint_every=10,
                log_every=10, steps_per_loop=10)
  handler_before = signal.getsignal(signal.SIGTERM)
  first = tfdist.train(train_steps=30, **common)
  assert first.checkpoint == f"{model_dir}/ckpt-30"
  resumed = tfdist.train(train_steps=60, **common)
  assert resumed.step == 60 and resumed.checkpoint == f"{model_dir}/ckpt-60"
  names = set(tf.io.gfile.listdir(model_dir))
  assert {"checkpoint", "ckpt-60.index", "export", "train", "eval",
          "tfdist_model.json"} <= names, names
  assert os.listdir(tmp_path) == ["fresh"]  # No local "ram:" directory.
  # The export is the checkpoint's model: its accuracy is the run's eval.
  served = tf.saved_model.load(resumed.export_dir).signatures[
      "serving_default"]
  test = digits.prepare(data_dir).as_dataset(split="test",
                                             as_supervised=True)
  correct = total = 0
  for images, labels in test.batch(128):
    classes = served(images=tf.cast(images, tf.float32) / 255.0)["classes"]
    correct += int(np.sum(classes.numpy() == labels.numpy()))
    total += int(labels.shape[0])
  assert total == resumed.eval_metrics["examples"] == 359
  assert correct / total == pytest.approx(
      resumed.eval_metrics["accuracy"], abs=1e-6)
  assert resumed.eval_metrics["accuracy"] > 0.8
  # The API trained inside this process and gave back its SIGTERM handling.
  assert signal.getsignal(signal.SIGTERM) is handler_before
  assert signal.set_wakeup_fd(-1) == -1


def test_trainer_features_on_a_remote_model_dir(tmp_path, monkeypatch):
  """ram://, in this process, with a learning rate that trains: the best
  checkpoint and its export, early stopping, EMA (the eval's weights are
  not the trained ones), --mode=eval reproducing the last eval, and a
  warm start from the remote best checkpoint."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  model_dir = "ram://tfdist-features/run"
  common = dict(model="mlp", dataset="digits", data_dir=str(tmp_path / "d"),
                log_every=10, steps_per_loop=10, optimizer="sgd")
  run = tfdist.train(**common, model_dir=model_dir, train_steps=100,
                     eval_every=10, learning_rate=0.05,
                     best_metric="accuracy", early_stopping_patience=2,
                     ema_decay=0.5)
  # The best and the stop follow the evals as they came.
  evals = artifacts.scalars(f"{model_dir}/eval", "accuracy")
  best_step, best_value, stop, since = None, -1.0, 100, 0
  for step, value in evals:
    if value > best_value:
      best_step, best_value, since = step, value, 0
    else:
      since += 1
      if since == 2:
        stop = step
        break
  assert run.step == stop and evals[-1][0] == stop
  best = json.loads(tf.io.gfile.GFile(
      f"{model_dir}/best_checkpoint/best.json").read())
  assert best["step"] == best_step
  assert best["value"] == pytest.approx(best_value, abs=1e-6)
  assert tf.io.gfile.exists(f"{model_dir}/best_export/saved_model.pb")
  again = tfdist.train(**common, model_dir=model_dir, mode="eval",
                       ema_decay=0.5)
  assert again.eval_metrics == pytest.approx(run.eval_metrics, abs=1e-6)
  raw = tfdist.train(**common, model_dir=model_dir, mode="eval")
  assert raw.eval_metrics["loss"] != pytest.approx(
      run.eval_metrics["loss"], abs=1e-4)  # The average was swapped in.
  best_raw = tfdist.train(
      **common, model_dir=model_dir, mode="eval",
      checkpoint=f"{model_dir}/best_checkpoint/ckpt-{best_step}")
  warm = tfdist.train(**common, model_dir=str(tmp_path / "warm"),
                      train_steps=10, learning_rate=0.0, eval_every=0,
                      init_checkpoint=f"{model_dir}/best_checkpoint")
  assert warm.eval_metrics["loss"] == pytest.approx(
      best_raw.eval_metrics["loss"], abs=1e-6)
  cold = tfdist.train(**common, model_dir=str(tmp_path / "cold"),
                      train_steps=10, learning_rate=0.0, eval_every=0)
  assert cold.eval_metrics["loss"] != pytest.approx(
      warm.eval_metrics["loss"], abs=1e-3)  # The warm start loaded.
  assert sorted(os.listdir(tmp_path)) == ["cold", "d", "warm"]


class _UnusedBranchTask:
  """Built lazily: a Task whose model has a layer the loss never reaches
  (a None gradient) and a metric that makes its state on first use."""

  @staticmethod
  def make():
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top

    class WithUnused(keras.Model):

      def __init__(self):
        super().__init__()
        self.used = keras.layers.Dense(3, name="used")
        self.unused = keras.layers.Dense(3, name="unused")

      def build(self, shape):
        self.used.build(shape)
        self.unused.build(shape)

      def call(self, x):
        return self.used(x)

    class CountOnFirstUse(keras.metrics.Metric):
      """Counts weighted examples; its variable appears on first update."""

      def __init__(self, name="counted"):
        super().__init__(name=name)
        self.total = None

      def update_state(self, y_true, y_pred, sample_weight=None):
        if self.total is None:
          self.total = self.add_variable(shape=(), initializer="zeros",
                                         name="total", aggregation="sum")
        weights = (tf.ones_like(y_pred[:, 0]) if sample_weight is None
                   else sample_weight)
        self.total.assign_add(tf.reduce_sum(tf.cast(weights, "float32")))

      def result(self):
        return keras.ops.cast(self.total, "float32")  # Read in scope.

    class Task(tfdist.Task):
      name = "unused_branch"

      def build_model(self):
        return WithUnused()

      def datasets(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(300, 4)).astype("float32")
        y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0)
        return (tf.data.Dataset.from_tensor_slices((x[:256], y[:256])),
                tf.data.Dataset.from_tensor_slices((x[256:], y[256:])))

      def metrics(self):
        return [CountOnFirstUse()]

    return Task()


def test_accumulation_with_an_unreached_variable_and_a_lazy_metric(tmp_path):
  """--grad_accum_steps=2 with a variable the loss never reaches: it
  trains, that variable stays as initialised, and the weights equal those
  of the same global batch in one step. A metric that makes its state on
  first use counts the 44 eval examples."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  results = {}
  for accum in (1, 2):
    results[accum] = tfdist.train(
        _UnusedBranchTask.make(), model_dir=str(tmp_path / f"a{accum}"),
        train_steps=20, batch_size=32, grad_accum_steps=accum,
        optimizer="sgd", learning_rate=0.1, eval_every=0, export=False)
    assert results[accum].eval_metrics["counted"] == 44.0
  def values(name):
    reader = tf.train.load_checkpoint(str(tmp_path / name))
    return {key: reader.get_tensor(key)
            for key in reader.get_variable_to_shape_map()
            if key.startswith("model/")}
  one, two = values("a1"), values("a2")
  assert len(two) == 4, sorted(two)
  for key in one:
    np.testing.assert_allclose(two[key], one[key], rtol=1e-5, atol=1e-7,
                               err_msg=key)
  # The unreached layer is as initialised: tfdist seeds with --seed (42)
  # just before it builds the model, so the same seed rebuilds step 0.
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(42)
  fresh = _UnusedBranchTask.make().build_model()
  fresh.build((None, 4))
  prefix = "model/unused/"
  np.testing.assert_array_equal(
      two[prefix + "_kernel/.ATTRIBUTES/VARIABLE_VALUE"],
      fresh.unused.kernel.numpy())
  assert not np.array_equal(
      two["model/used/_kernel/.ATTRIBUTES/VARIABLE_VALUE"],
      fresh.used.kernel.numpy())


_HOST_PROCESS = '''
import os, signal, sys, threading, time
import keras
import tfdist


class SigtermAtEnd(keras.callbacks.Callback):
  def on_train_end(self, logs=None):
    os.kill(os.getpid(), signal.SIGTERM)  # After the last loop call.


common = dict(model="mlp", dataset="digits", data_dir=sys.argv[1],
              model_dir=sys.argv[2], train_steps=10, eval_every=0,
              log_every=10, steps_per_loop=10, sigterm_grace_seconds=1)
if sys.argv[3] == "late_sigterm":
  result = tfdist.train(callbacks=[SigtermAtEnd()], **common)
  time.sleep(4)  # Past the watchdog's grace.
else:
  results = []
  thread = threading.Thread(
      target=lambda: results.append(tfdist.train(**common)))
  thread.start()
  thread.join()
  result = results[0]
print("host alive at step", result.step)
'''


@pytest.mark.parametrize("case", ["late_sigterm", "other_thread"])
def test_the_python_api_in_a_host_process(tmp_path, data_dir, case):
  """late_sigterm: a SIGTERM after the last loop call (in on_train_end,
  after the export) does not end the host process once tfdist.train()
  has returned. other_thread: tfdist.train() from a thread that is not
  the main one trains, and says in one line that SIGTERM is not caught."""
  script = tmp_path / "host.py"
  script.write_text(_HOST_PROCESS)
  proc = subprocess.run(
      [sys.executable, str(script), data_dir, str(tmp_path / "run"), case],
      cwd=tmp_path, capture_output=True, text=True, timeout=300,
      env={**os.environ, "PYTHONPATH": ROOT})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "host alive at step 10" in proc.stdout
  assert "Traceback" not in proc.stderr
  warned = "tfdist runs outside the main thread" in proc.stderr
  assert warned == (case == "other_thread")
