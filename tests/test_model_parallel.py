"""Model parallelism: placement plans, tensor-parallel layers against their
unsplit twins, and training equivalence of pipeline, tensor and hybrid runs
with the unsplit single-device run."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import artifacts
from conftest import run_cli
from conftest import run_launcher
from tfdist.models import parallel_layers
from tfdist import devices
from tfdist import placement
from tfdist.errors import ConfigError

DEVICES = ["/device:CPU:0", "/device:CPU:1"]


def test_auto_plan_balances_parameters_and_keeps_order():
  blocks = [("a", 10), ("b", 10), ("c", 80), ("d", 20), ("e", 0)]
  plan = placement.auto_plan(blocks, DEVICES, 2)
  assert [s.blocks for s in plan.stages] == [("a", "b", "c"), ("d", "e")]
  plan = placement.auto_plan(blocks, ["/cpu:0", "/cpu:1", "/cpu:2"], 3)
  assert [s.blocks for s in plan.stages] == [("a", "b"), ("c",), ("d", "e")]
  with pytest.raises(ConfigError, match="more than the model's 5 blocks"):
    placement.auto_plan(blocks, DEVICES * 3, 6)


def test_spec_plan_groups_runs_and_names_unmatched_blocks(tmp_path):
  rules = placement.parse_spec("embed=/device:CPU:0;block*=/device:CPU:1;"
                               "head=/device:CPU:1")
  plan = placement.plan_from_spec(rules, ["embed", "block0", "block1",
                                          "head"])
  assert [(s.device, s.blocks) for s in plan.stages] == [
      ("/device:CPU:0", ("embed",)),
      ("/device:CPU:1", ("block0", "block1", "head"))]
  spec = tmp_path / "plan.json"
  spec.write_text('{"*": "/device:CPU:1"}')
  assert placement.parse_spec(str(spec)) == {"*": "/device:CPU:1"}
  with pytest.raises(ConfigError, match="no --placement pattern matches"):
    placement.plan_from_spec({"x*": "/device:CPU:0"}, ["embed"])
  with pytest.raises(ConfigError, match="pattern=device"):
    placement.parse_spec("embed:/device:CPU:0")
  with pytest.raises(ConfigError, match="'/device:CPU:9', which does not"):
    placement.check_devices(["/device:CPU:9"], devices.local_devices())


def _grads(layer, x):
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = layer(x)
    loss = tf.reduce_sum(y * tf.cos(y))
  return y, tape.gradient(loss, [x] + layer.trainable_variables)


@pytest.mark.parametrize("width", [2, 4])
def test_column_and_row_parallel_match_dense(width):
  devices = [f"/device:CPU:{i}" for i in range(width)]
  x = tf.random.stateless_normal([5, 12], seed=(1, 2))
  keras.utils.set_random_seed(3)
  dense = keras.layers.Dense(8, activation="relu")
  keras.utils.set_random_seed(3)
  column = parallel_layers.ColumnParallelDense(8, devices=devices,
                                               activation="relu")
  y_dense, (dx_dense, dk, db) = _grads(dense, x)
  y_col, col_grads = _grads(column, x)
  np.testing.assert_allclose(y_col, y_dense, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(col_grads[0], dx_dense, rtol=1e-5, atol=1e-6)
  shard_grads = col_grads[1:]  # kernel_0, bias_0, kernel_1, bias_1, ...
  np.testing.assert_allclose(np.concatenate(shard_grads[0::2], axis=1), dk,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.concatenate(shard_grads[1::2]), db,
                             rtol=1e-5, atol=1e-6)
  for kernel, device in zip(column.kernels, devices):
    assert kernel.value.device.endswith(device.split("/")[-1])

  keras.utils.set_random_seed(4)
  dense = keras.layers.Dense(6)
  keras.utils.set_random_seed(4)
  row = parallel_layers.RowParallelDense(6, devices=devices)
  y_dense, (dx_dense, dk, db) = _grads(dense, x)
  y_row, row_grads = _grads(row, x)
  np.testing.assert_allclose(y_row, y_dense, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(row_grads[0], dx_dense, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.concatenate(row_grads[1:-1]), dk,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(row_grads[-1], db, rtol=1e-5, atol=1e-6)


def test_column_split_joined_by_sum_would_be_wrong():
  """The seed article's form (column split, then SUM) is not the layer."""
  x = tf.random.stateless_normal([3, 4], seed=(5, 6))
  column = parallel_layers.ColumnParallelDense(6, devices=DEVICES,
                                               gather_output=False)
  shards = column(x)
  right = tf.concat(shards, axis=-1)
  assert right.shape == (3, 6)
  wrong = tf.add_n(shards)
  assert wrong.shape == (3, 3)


def test_tensor_parallel_mlp_block_matches_and_reduces_once():
  x = tf.random.stateless_normal([4, 7, 16], seed=(7, 8))
  keras.utils.set_random_seed(9)
  unsplit = keras.Sequential([keras.layers.Dense(32, activation="gelu"),
                              keras.layers.Dense(16)])
  keras.utils.set_random_seed(9)
  split = parallel_layers.TensorParallelMLP(32, 16, devices=DEVICES,
                                            inner_activation="gelu")
  y_unsplit, g_unsplit = _grads(unsplit, x)
  y_split, g_split = _grads(split, x)
  np.testing.assert_allclose(y_split, y_unsplit, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g_split[0], g_unsplit[0], rtol=1e-5, atol=1e-6)
  graph = tf.function(split).get_concrete_function(
      tf.TensorSpec([4, 7, 16])).graph
  assert [op.type for op in graph.get_operations()].count("AddN") == 1
  assert "ConcatV2" not in [op.type for op in graph.get_operations()]


def test_tensor_parallel_attention_matches_and_reduces_once():
  x = tf.random.stateless_normal([3, 8, 16], seed=(10, 11))
  keras.utils.set_random_seed(12)
  unsplit = parallel_layers.SelfAttention(16, 4)
  keras.utils.set_random_seed(12)
  split = parallel_layers.SelfAttention(16, 4, devices=DEVICES)
  y_unsplit, g_unsplit = _grads(unsplit, x)
  y_split, g_split = _grads(split, x)
  np.testing.assert_allclose(y_split, y_unsplit, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g_split[0], g_unsplit[0], rtol=1e-5, atol=1e-6)
  for kernel, device in zip(split.query.kernels, DEVICES):
    assert kernel.value.device.endswith(device.split("/")[-1])
  graph = tf.function(split).get_concrete_function(
      tf.TensorSpec([3, 8, 16])).graph
  assert [op.type for op in graph.get_operations()].count("AddN") == 1
  with pytest.raises(ConfigError, match="must divide the attention heads"):
    parallel_layers.SelfAttention(16, 3, devices=DEVICES)


def test_tensor_parallel_degree_must_divide_width():
  with pytest.raises(ConfigError, match="Received: width=10 for "
                     "tensor_parallel=3"):
    parallel_layers.ColumnParallelDense(10, devices=DEVICES + ["/cpu:2"])


COMMON = ["--batch_size=64", "--steps_per_loop=4", "--log_every=2",
          "--eval_every=0", "--checkpoint_every=0", "--seed=7",
          "--train_steps=20"]


def _logits(model_dir):
  from tfdist import digits
  images, _ = digits._split_arrays("test")
  serve = tf.saved_model.load(os.path.join(model_dir, "export")).signatures[
      "serving_default"]
  return serve(images=tf.constant(images / 255.0, tf.float32))[
      "logits"].numpy()


def _train(tmp_path, data_dir, name, *flags):
  model_dir = str(tmp_path / name)
  run_cli(f"--model_dir={model_dir}", f"--data_dir={data_dir}", *COMMON,
          *flags)
  return model_dir


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_dir):
  root = tmp_path_factory.mktemp("unsplit")
  return {model: _train(root, data_dir, model, f"--model={model}",
                        "--strategy=default")
          for model in ("mlp", "transformer")}


@pytest.mark.parametrize("model,flags", [
    ("mlp", ["--model_parallel=pipeline", "--num_stages=2",
             "--num_microbatches=4", "--num_cpu_devices=2"]),
    ("mlp", ["--model_parallel=tensor", "--tensor_parallel=2",
             "--num_cpu_devices=2"]),
    ("transformer", ["--model_parallel=pipeline", "--num_stages=4",
                     "--num_microbatches=2", "--num_cpu_devices=4"]),
    ("transformer", ["--model_parallel=tensor", "--tensor_parallel=2",
                     "--num_cpu_devices=2"]),
])
def test_split_training_matches_unsplit(model, flags, references, tmp_path,
                                        data_dir):
  split = _train(tmp_path, data_dir, "split", f"--model={model}", *flags)
  assert artifacts.checkpoint_step(split) == 20
  np.testing.assert_allclose(_logits(split), _logits(references[model]),
                             rtol=1e-5, atol=2e-5)
  curve = [v for _, v in artifacts.scalars(f"{split}/train", "loss")]
  reference = [v for _, v in artifacts.scalars(
      f"{references[model]}/train", "loss")]
  np.testing.assert_allclose(curve, reference, rtol=1e-5)
  device_bytes = artifacts.summary_tags(f"{split}/train")
  assert {"variable_bytes/CPU:0", "variable_bytes/CPU:1"} <= device_bytes


def test_hybrid_two_workers_times_two_devices_matches_unsplit(
    references, tmp_path, data_dir):
  model_dir = str(tmp_path / "hybrid")
  run_launcher(["--workers=2"], [
      f"--model_dir={model_dir}", f"--data_dir={data_dir}", *COMMON,
      "--model=mlp", "--strategy=multi_worker_mirrored",
      "--model_parallel=pipeline", "--num_stages=2", "--num_microbatches=2",
      "--num_cpu_devices=2"])
  artifacts.assert_weights_close(artifacts.model_weights(model_dir),
                                 artifacts.model_weights(references["mlp"]),
                                 rtol=1e-5)
