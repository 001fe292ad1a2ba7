"""PowerSGD's all-reduce on a real MirroredStrategy over 2 logical CPUs:
full rank gives the plain sum, error feedback keeps what is not sent, and
the element counts that set the bytes on the wire."""

import json
import types

import numpy as np
import pytest
import tensorflow as tf

from conftest import long_test
from conftest import run_cli
from tfdist import compression

SHAPES = [(64, 32), (3, 3, 4, 8), (32,), (100, 10)]


def _replica_grads(step, shapes=SHAPES):
  """Different gradients on each replica and at each step."""
  def grads(replica):
    return [tf.random.stateless_normal(s, seed=(step, replica * 100 + i))
            for i, s in enumerate(shapes)]
  return grads


def _run_steps(strategy, reducer, steps, shapes=SHAPES):
  """Per step: (reduced sums, exact sums), as numpy."""
  @tf.function
  def one(step):
    def replica_fn():
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      return reducer.reduce(_replica_grads(step, shapes)(replica))
    reduced = strategy.run(replica_fn)
    return [strategy.experimental_local_results(t)[0] for t in reduced]
  results = []
  for step in range(steps):
    exact = [sum(parts) for parts in zip(
        *(_replica_grads(step, shapes)(r) for r in range(2)))]
    results.append(([t.numpy() for t in one(tf.constant(step))],
                    [t.numpy() for t in exact]))
  return results


def _reducer(strategy, rank, min_ratio=2.0):
  with strategy.scope():
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    return compression.PowerSGDReducer(variables=variables, rank=rank,
                                       min_ratio=min_ratio)


def test_full_rank_equals_the_plain_all_reduce(two_cpu_strategy):
  strategy = two_cpu_strategy
  # min_ratio=0 compresses every matrix, even where that sends more.
  reducer = _reducer(strategy, rank=1000, min_ratio=0)
  assert reducer.compressed_indices == [0, 1, 3]
  for reduced, plain in _run_steps(strategy, reducer, steps=3):
    for got, want in zip(reduced, plain):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_error_feedback_keeps_what_was_not_sent(two_cpu_strategy):
  """Over K steps, what was sent plus what the replicas still hold in their
  error buffers is exactly the sum of all gradients."""
  strategy = two_cpu_strategy
  reducer = _reducer(strategy, rank=1)
  steps = _run_steps(strategy, reducer, steps=4)
  for i in reducer.compressed_indices:
    sent = sum(reduced[i] for reduced, _ in steps)
    true = sum(plain[i] for _, plain in steps)
    held = sum(e.numpy() for e in strategy.experimental_local_results(
        reducer._errors[i]))  # pylint: disable=protected-access
    assert np.linalg.norm(held) > 0.1 * np.linalg.norm(true)  # Lossy.
    np.testing.assert_allclose(sent + held.reshape(sent.shape), true,
                               rtol=1e-4, atol=1e-4)
  # The bias is not compressed: sent exactly.
  for reduced, plain in steps:
    np.testing.assert_allclose(reduced[2], plain[2], rtol=1e-6)


def test_reset_clears_errors_and_restarts_q(two_cpu_strategy):
  strategy = two_cpu_strategy
  reducer = _reducer(strategy, rank=2)
  first = _run_steps(strategy, reducer, steps=1)
  _run_steps(strategy, reducer, steps=2)
  reducer.reset()
  for error in reducer._errors.values():  # pylint: disable=protected-access
    for copy in strategy.experimental_local_results(error):
      assert not np.any(copy.numpy())
  # Fresh buffers and Q: step 0 again gives step 0's result.
  again = _run_steps(strategy, reducer, steps=1)
  for got, want in zip(again[0][0], first[0][0]):
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_warm_start_converges_to_the_top_singular_pair(two_cpu_strategy):
  """The same rank-2 gradient every step: Q carried over makes it a power
  iteration, so the rank-1 message converges to sigma_1 u_1 v_1^T."""
  strategy = two_cpu_strategy
  u = np.linalg.qr(np.random.default_rng(0).normal(size=(64, 2)))[0]
  v = np.linalg.qr(np.random.default_rng(1).normal(size=(32, 2)))[0]
  gradient = (u * [3.0, 1.0]) @ v.T
  with strategy.scope():
    reducer = compression.PowerSGDReducer(
        variables=[tf.Variable(tf.zeros([64, 32]))], rank=1)

  @tf.function
  def step():
    def replica_fn():
      reduced = reducer.reduce([tf.constant(gradient / 2, tf.float32)])[0]
      # No error feedback here, to watch the projection alone.
      for error in reducer._errors.values():  # pylint: disable=protected-access
        error.assign(tf.zeros_like(error))
      return reduced
    return strategy.experimental_local_results(strategy.run(replica_fn))[0]
  for _ in range(8):
    message = step().numpy()
  best = 3.0 * np.outer(u[:, 0], v[:, 0])
  np.testing.assert_allclose(message, best, atol=1e-3)


@pytest.mark.parametrize("rank,ratio", [(4, 50)])
def test_mlp_wide_sends_at_least_50x_fewer_elements(rank, ratio):
  shapes = [(64, 2048), (2048,), (2048, 2048), (2048,), (2048, 10), (10,)]
  sent, plain = compression.wire_elements(shapes, rank)
  assert plain / sent >= ratio, (plain, sent)
  # Vectors and matrices that would not halve go as they are.
  assert compression.compressed_rank((2048,), 4, 2.0) == 0
  assert compression.compressed_rank((16, 10), 4, 2.0) == 0
  assert compression.compressed_rank((3, 3, 16, 32), 4, 2.0) == 4


def _weights_at(model_dir, step):
  reader = tf.train.load_checkpoint(f"{model_dir}/ckpt-{step}")
  return {key: reader.get_tensor(key)
          for key in reader.get_variable_to_shape_map()
          if key.startswith("optimizer/_trainable_variables/")}


def _final_accuracy(metrics_file):
  with open(metrics_file) as lines:
    return json.loads(lines.read().splitlines()[-1])["accuracy"]


def test_powersgd_run_starts_where_asked_and_keeps_accuracy(tmp_path,
                                                            data_dir):
  """2 mirrored replicas, mlp on digits: until --powersgd_start_step the run
  is the float32 run exactly; after it, PowerSGD rank 4 ends within 1 point
  of float32's accuracy, and its buffers stay out of the checkpoint."""
  common = [f"--data_dir={data_dir}", "--strategy=mirrored",
            "--num_cpu_devices=2", "--model=mlp", "--train_steps=200",
            "--batch_size=64", "--steps_per_loop=30", "--checkpoint_every=45",
            "--keep_checkpoints=10", "--eval_every=0", "--seed=3",
            "--noexport"]
  dirs = {}
  for name, flags in (("float32", []),
                      ("powersgd", ["--allreduce_compression=powersgd",
                                    "--powersgd_rank=4",
                                    "--powersgd_start_step=100"])):
    dirs[name] = str(tmp_path / name)
    proc = run_cli(f"--model_dir={dirs[name]}",
                   f"--metrics_file={tmp_path / name}.jsonl", *common, *flags)
  assert "PowerSGD rank 4 from step 100: 3 of 6 gradients compressed" in (
      proc.stdout + proc.stderr)
  before = [_weights_at(dirs[n], 90) for n in dirs]
  after = [_weights_at(dirs[n], 135) for n in dirs]
  assert sorted(before[0]) == sorted(before[1])
  for key in before[0]:
    np.testing.assert_array_equal(before[1][key], before[0][key], key)
  assert any(not np.allclose(after[0][k], after[1][k]) for k in after[0])
  float32, powersgd = (_final_accuracy(f"{tmp_path / n}.jsonl") for n in dirs)
  assert float32 > 0.9
  assert abs(powersgd - float32) <= 0.01, (powersgd, float32)


@pytest.mark.parametrize("model,flags,steps,learned", [
    ("mlp_wide", ["--dataset=digits"], 300, 0.9),
    # Learnable 32x32x3 data in 10 classes (tests/cifar_shaped.py); its
    # convolution kernels are the reshaped matrices PowerSGD compresses.
    # A cosine decay to 0 lets both runs settle; at a constant rate the
    # eval accuracy of either moved by several points between evals.
    ("resnet20", ["--dataset=tests.cifar_shaped:data", "--batch_size=32",
                  "--lr_schedule=cosine"], 400, 0.85),
])
def test_powersgd_rank4_accuracy_within_a_point(model, flags, steps, learned,
                                                tmp_path, data_dir):
  """The issue's accuracy bar, on 2 mirrored replicas: rank 4 ends within 1
  point of float32."""
  long_test("two runs of a wide model or a ResNet; 3-10 minutes on 2 CPUs")
  accuracy = {}
  for name, extra in (("float32", []),
                      ("powersgd", ["--allreduce_compression=powersgd",
                                    "--powersgd_rank=4"])):
    metrics = tmp_path / f"{name}.jsonl"
    run_cli(f"--model_dir={tmp_path / name}", f"--data_dir={data_dir}",
            f"--model={model}", *flags, "--strategy=mirrored",
            "--num_cpu_devices=2", f"--train_steps={steps}", "--eval_every=0",
            "--checkpoint_every=0", "--noexport", "--seed=5",
            f"--metrics_file={metrics}", *extra, timeout=1800)
    accuracy[name] = _final_accuracy(metrics)
  print(model, accuracy)
  assert accuracy["float32"] > learned
  assert abs(accuracy["powersgd"] - accuracy["float32"]) <= 0.01, accuracy


@pytest.mark.parametrize("strategy", ["parameter_server", "tpu"])
def test_powersgd_needs_a_synchronous_all_reduce(strategy):
  from tfdist import config as config_lib
  from tfdist import preflight
  from tfdist import strategies
  from tfdist.errors import ConfigError
  config = config_lib.Config(model_dir="unused", strategy=strategy,
                             allreduce_compression="powersgd")
  info = strategies.StrategyInfo(
      strategy=types.SimpleNamespace(num_replicas_in_sync=2), name=strategy,
      reason="test")
  with pytest.raises(ConfigError, match=(
      "--allreduce_compression=powersgd replaces the synchronous gradient "
      f"all-reduce of mirrored and multi_worker_mirrored. Received: "
      f"strategy={strategy}")):
    preflight.check_run(config, info, ["/cpu:0"])


def test_powersgd_refuses_loss_scaled_float16():
  from tfdist import config as config_lib
  from tfdist.errors import ConfigError
  with pytest.raises(ConfigError, match="Received: allreduce_compression="
                     "powersgd with mixed_precision=mixed_float16"):
    config_lib.Config(model_dir="unused", allreduce_compression="powersgd",
                      mixed_precision="mixed_float16")
