"""--shard (--shard_optimizer, ZeRO stage 1; --shard=params, stage 3)
through the CLI: real runs, compared through their checkpoints with the
default strategy's run.

A sharded run's checkpoint has the keys and values of an unsharded one:
the weights and every optimizer slot, whole (rtol 1e-5). Each replica
holds 1/N of the state (TensorBoard's optimizer_bytes/<device>; with
params, variable_bytes/<device> too), and a run resumes across replica
counts and sharding stages, with the weights of the uninterrupted run.
"""

import re
import subprocess
import sys

import numpy as np
import pytest

import artifacts
from conftest import ROOT
from conftest import run_cli
from conftest import run_launcher

COMMON = ["--steps_per_loop=5", "--eval_every=0", "--noexport",
          "--batch_size=64"]
OPTIMIZERS = {"adam": ["--optimizer=adam"],
              "momentum": ["--optimizer=momentum", "--learning_rate=0.05"]}


def _train(model_dir, data_dir, steps, *extra):
  return run_cli(f"--model_dir={model_dir}", f"--data_dir={data_dir}",
                 *COMMON, f"--train_steps={steps}", *extra)


def _checkpoint_values(model_dir):
  """{key: array} of the latest checkpoint, bookkeeping aside."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(
      str(model_dir)))
  return {key: reader.get_tensor(key)
          for key in reader.get_variable_to_shape_map()
          if not key.startswith(("_CHECKPOINTABLE", "save_counter"))}


def _assert_same_checkpoint(ours, reference):
  a, b = _checkpoint_values(ours), _checkpoint_values(reference)
  assert sorted(a) == sorted(b)
  assert any("_variables/" in k for k in b)  # The slots are compared too.
  for key in b:
    np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6,
                               err_msg=key)


def _slot_bytes(model_dir):
  weights = artifacts.model_weights(str(model_dir))
  return sum(v.nbytes for k, v in weights.items()
             if k.startswith("optimizer/_variables/"))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, data_dir):
  """optimizer -> the model_dir of its 20-step run on one device, trained
  once for every test that compares with it."""
  runs = {}

  def run(optimizer):
    if optimizer not in runs:
      model_dir = tmp_path_factory.mktemp(optimizer) / "one"
      _train(model_dir, data_dir, 20, *OPTIMIZERS[optimizer])
      runs[optimizer] = model_dir  # Only a run that finished.
    return runs[optimizer]
  return run


@pytest.mark.parametrize("replicas,optimizer,shard", [
    (2, "adam", "--shard_optimizer"), (4, "momentum", "--shard_optimizer"),
    (2, "adam", "--shard=params"), (4, "momentum", "--shard=params")])
def test_mirrored_sharded_run_keeps_one_devices_weights_and_slots(
    tmp_path, data_dir, replicas, optimizer, shard, one_device):
  one = one_device(optimizer)
  proc = _train(tmp_path / "sharded", data_dir, 20, *OPTIMIZERS[optimizer],
                "--strategy=mirrored", f"--num_cpu_devices={replicas}",
                shard)
  _assert_same_checkpoint(tmp_path / "sharded", one)
  whole = _slot_bytes(one)
  for device in range(replicas):
    [(_, held)] = artifacts.scalars(str(tmp_path / "sharded" / "train"),
                                    f"optimizer_bytes/CPU:{device}")
    # 1/N of the slots (padding below N elements), plus the step count
    # and the rate the run's own optimizer keeps.
    assert whole / replicas <= held < whole / replicas + 64 + 4 * replicas
    if shard == "--shard=params":  # 1/N of the weights (all trainable).
      [(_, weights)] = artifacts.scalars(
          str(tmp_path / "sharded" / "train"), f"variable_bytes/CPU:{device}")
      assert whole / slots_of(optimizer) / replicas <= weights < (
          whole / slots_of(optimizer) / replicas + 64)
  [ratio] = re.findall(r"\(optimizer state ([0-9.]+)x the trainable "
                       r"weights\)", proc.stderr)
  assert abs(float(ratio) - slots_of(optimizer) / replicas) <= 0.05, ratio


def slots_of(optimizer):
  return 2 if optimizer == "adam" else 1


@pytest.mark.parametrize("shard", ["--shard_optimizer", "--shard=params"])
def test_two_workers_sharded_keep_one_devices_weights_and_slots(
    tmp_path, data_dir, one_device, shard):
  # --shard=params stops at step 10 and resumes: each worker restores the
  # box of each entry that its shard's elements lie in.
  for steps in ([10, 20] if shard == "--shard=params" else [20]):
    proc = run_launcher(
        ["--workers=2", "--isolate=off"],
        [f"--model_dir={tmp_path / 'sharded'}", f"--data_dir={data_dir}",
         *COMMON, f"--train_steps={steps}", *OPTIMIZERS["momentum"],
         "--strategy=multi_worker_mirrored", shard])
  assert "optimizer state 0.5x the trainable weights" in proc.stdout
  assert shard != "--shard=params" or "at step 10." in proc.stdout
  _assert_same_checkpoint(tmp_path / "sharded", one_device("momentum"))


@pytest.mark.parametrize("shard", ["--shard_optimizer", "--shard=params"])
def test_resume_sharded_unsharded_sharded_across_replica_counts(
    tmp_path, data_dir, shard):
  _train(tmp_path / "straight", data_dir, 30)
  chain = tmp_path / "chain"
  _train(chain, data_dir, 10, "--strategy=mirrored", "--num_cpu_devices=2",
         shard)
  _train(chain, data_dir, 20)
  # --shard=gradients is the same update as --shard_optimizer.
  last = _train(chain, data_dir, 30, "--strategy=mirrored",
                "--num_cpu_devices=4",
                "--shard=gradients" if shard == "--shard_optimizer" else shard)
  assert "Resumed from" in last.stderr and "at step 20" in last.stderr
  _assert_same_checkpoint(chain, tmp_path / "straight")


def test_params_eval_and_export_match_one_device(tmp_path, data_dir):
  # Eval runs the units on gathered weights; the export holds them whole.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  runs = {}
  for name, extra in (("one", []), ("params", [
      "--strategy=mirrored", "--num_cpu_devices=2", "--shard=params"])):
    proc = _train(tmp_path / name, data_dir, 10, "--export",
                  "--optimizer=momentum", *extra)
    [line] = [l for l in proc.stderr.splitlines() if "eval  step 10" in l]
    metrics = [float(x) for x in re.findall(r"(?:accuracy|loss) ([0-9.]+)",
                                            line)]
    serve = tf.saved_model.load(
        str(tmp_path / name / "export")).signatures["serving_default"]
    [(input_name, spec)] = serve.structured_input_signature[1].items()
    outputs = serve(**{input_name: tf.random.stateless_uniform(
        [5, *spec.shape[1:]], seed=[1, 2], dtype=spec.dtype)})
    runs[name] = (metrics, next(iter(outputs.values())).numpy())
  assert len(runs["one"][0]) == 2
  np.testing.assert_allclose(runs["params"][0], runs["one"][0], rtol=1e-4)
  np.testing.assert_allclose(runs["params"][1], runs["one"][1], rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("extra,message", [
    (["--shard_optimizer", "--strategy=default"],
     "--shard_optimizer splits the training state over synchronous "
     "replicas: --strategy=mirrored or multi_worker_mirrored. Received: "
     "strategy=default"),
    (["--shard_optimizer", "--strategy=mirrored", "--ema_decay=0.9"],
     "Received: ema_decay=0.9"),
    (["--shard_optimizer", "--strategy=mirrored",
      "--allreduce_compression=powersgd"],
     "Received: allreduce_compression=powersgd"),
    (["--shard_optimizer", "--strategy=mirrored", "--shard=params"],
     "--shard_optimizer is --shard=optimizer; give one of them. Received: "
     "shard_optimizer=True with shard=params"),
    (["--shard=params", "--strategy=default"],
     "--shard=params splits the training state over synchronous replicas"),
    (["--shard=params", "--strategy=mirrored", "--grad_accum_steps=2"],
     "Received: grad_accum_steps=2"),
    (["--shard=params", "--strategy=mirrored", "--sync_batchnorm",
      "--mixed_precision=mixed_bfloat16"],
     "Received: mixed_precision=mixed_bfloat16, sync_batchnorm=True"),
    (["--shard_optimizer", "--noreshard_after_forward"],
     "Received: reshard_after_forward=False with shard=optimizer"),
    # Found when the model's forward is traced, before any step.
    (["--shard=params", "--strategy=mirrored", "--num_cpu_devices=2",
      "--model=tests.sharded_models:tied"],
     "sharded weights: tied/dense/kernel is read or set outside its own "
     "layer's call"),
    (["--shard=params", "--strategy=mirrored", "--num_cpu_devices=2",
      "--model=tests.sharded_models:random_inside"],
     "draws TF stateful random numbers (RandomUniform)"),
    (["--shard=params", "--strategy=mirrored", "--num_cpu_devices=2",
      "--callbacks=tests.sharded_models:keeps_best_weights"],
     "EarlyStopping(restore_best_weights=True) keeps the model's whole "
     "weights"),
])
def test_what_sharding_cannot_do_is_one_line(tmp_path, data_dir, extra,
                                             message):
  proc = run_cli(f"--model_dir={tmp_path / 'run'}", f"--data_dir={data_dir}",
                 *extra, check=False)
  assert proc.returncode != 0
  errors = [l for l in proc.stderr.splitlines() if "tfdist: error:" in l]
  assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "run").exists() or not any(
      (tmp_path / "run").iterdir())


_UNREACHED = """
import sys
sys.path.insert(0, "tests")
from test_off_path import _UnusedBranchTask
import tfdist
tfdist.train(_UnusedBranchTask.make(), model_dir=sys.argv[1], train_steps=20,
             batch_size=32, eval_every=0, export=False, optimizer="adamw",
             weight_decay=0.1, learning_rate=0.1, **eval(sys.argv[2]))
"""


def test_a_variable_the_loss_never_reaches_keeps_its_weights(tmp_path):
  # As Keras skips it: its weights stay (AdamW's decay would move them)
  # and its slots stay zero. A subprocess each: the logical CPUs are
  # fixed at start-up.
  mirrored = "dict(strategy='mirrored', num_cpu_devices=2, "
  for name, kwargs in (("one", "{}"),
                       ("optimizer", mirrored + "shard_optimizer=True)"),
                       ("params", mirrored + "shard='params')")):
    subprocess.run([sys.executable, "-c", _UNREACHED, str(tmp_path / name),
                    kwargs], cwd=ROOT, check=True, capture_output=True,
                   timeout=300)
  for name in ("optimizer", "params"):
    _assert_same_checkpoint(tmp_path / name, tmp_path / "one")


def test_params_clip_by_the_summed_gradients_global_norm(tmp_path, data_dir):
  # The norm is the whole summed gradient's, from every unit's shards;
  # the gathered weights kept for the backward (reshard off).
  clip = ["--optimizer=momentum", "--learning_rate=0.05", "--clip_norm=0.05"]
  _train(tmp_path / "one", data_dir, 10, *clip)
  _train(tmp_path / "params", data_dir, 10, *clip, "--strategy=mirrored",
         "--num_cpu_devices=2", "--shard=params",
         "--noreshard_after_forward")
  _assert_same_checkpoint(tmp_path / "params", tmp_path / "one")


def test_a_model_that_cannot_be_built_deferred_is_built_whole(tmp_path,
                                                             data_dir):
  # A variable made from a value: Keras cannot defer it, so the model is
  # built whole, then sharded, and trains as one device does.
  model = ["--model=tests.sharded_models:from_value"]
  _train(tmp_path / "one", data_dir, 10, *model)
  proc = _train(tmp_path / "params", data_dir, 10, *model,
                "--strategy=mirrored", "--num_cpu_devices=2", "--shard=params")
  assert "makes a variable from a value" in proc.stderr
  _assert_same_checkpoint(tmp_path / "params", tmp_path / "one")


def test_workers_that_draw_other_weights_start_from_the_first_ones(
    tmp_path, data_dir):
  # Deferred, each worker's initializers give its own draw; the shards
  # must be of the first worker's, as the one device's run (task 0) is.
  model = ["--model=tests.sharded_models:seeded_by_task"]
  _train(tmp_path / "one", data_dir, 5, *model)
  run_launcher(["--workers=2", "--isolate=off"],
               [f"--model_dir={tmp_path / 'params'}",
                f"--data_dir={data_dir}", *COMMON, "--train_steps=5",
                *model, "--strategy=multi_worker_mirrored",
                "--shard=params"])
  _assert_same_checkpoint(tmp_path / "params", tmp_path / "one")
