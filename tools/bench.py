"""Benchmark: tfdist's loop against a hand-written loop and Keras fit.

python -m tools.bench [--rounds=5] [--steps=640] [--steps_per_loop=32]

Contenders run interleaved, round by round, in one process, on the same
model, data, optimizer and strategy; medians and their ratios are printed.
A second part compares the training FLOP/s tfdist reaches on a compute-bound
MLP with the FLOP/s of a raw tf.matmul measured in the same run.
"""

import dataclasses
import os
import statistics
import time

from absl import app
from absl import flags
from absl import logging

from tools import inprocess

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 5, "Interleaved rounds per contender.")
flags.DEFINE_integer("steps", 640, "Training steps per round (small MLP).")
flags.DEFINE_integer("steps_per_loop", 32, "Steps per tf.function call.")
flags.DEFINE_integer("batch_size", 256, "Global batch (small MLP).")
flags.DEFINE_integer("flops_steps", 20, "Steps per round (wide MLP).")
flags.DEFINE_integer("flops_batch_size", 512, "Global batch (wide MLP).")


def _handwritten_contender(config, info, dataset):
  """The minimal loop a TF engineer would write by hand."""
  import keras
  import tensorflow as tf
  import models
  from tfdist import data
  strategy = info.strategy
  with strategy.scope():
    model = models.build(config.model, input_shape=dataset.input_shape,
                         num_classes=dataset.num_classes)
    model(tf.zeros([1, *dataset.input_shape]))  # Create the variables.
    optimizer = keras.optimizers.Adam(config.learning_rate)
    optimizer.build(model.trainable_variables)
  iterator = iter(strategy.distribute_datasets_from_function(
      data.train_input_fn(dataset, global_batch_size=config.batch_size,
                          seed=config.seed)))

  def step(batch):
    images, labels, weights = batch
    with tf.GradientTape() as tape:
      logits = model(images, training=True)
      loss = tf.nn.compute_average_loss(
          keras.losses.sparse_categorical_crossentropy(
              labels, logits, from_logits=True) * weights,
          global_batch_size=config.batch_size)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  @tf.function
  def loop(iterator, num_steps):
    for _ in tf.range(num_steps):
      strategy.run(step, args=(next(iterator),))

  def run(steps):
    for _ in range(steps // config.steps_per_loop):
      loop(iterator, tf.constant(config.steps_per_loop))
    # Wait for the last step: read a weight.
    model.trainable_variables[0].numpy()
  return run


def _fit_contender(config, info, dataset, jit_compile="auto"):
  import keras
  import models
  from tfdist import data
  with info.strategy.scope():
    model = models.build(config.model, input_shape=dataset.input_shape,
                         num_classes=dataset.num_classes)
    model.compile(optimizer=keras.optimizers.Adam(config.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  metrics=["accuracy"],
                  steps_per_execution=config.steps_per_loop,
                  jit_compile=jit_compile)
  source = dataset.train_source().shuffle(
      data.SHUFFLE_BUFFER, seed=config.seed).repeat().batch(
          config.batch_size, drop_remainder=True).prefetch(-1)

  def run(steps):
    model.fit(source, steps_per_epoch=steps, epochs=1, verbose=0)
  return run


def _training_flops_per_example(model):
  """Dense layers: forward 2*MACs, weight grads 2*MACs, input grads 2*MACs
  except for the first layer, whose input needs no gradient."""
  kernels = [w for w in model.trainable_weights if len(w.shape) == 2]
  macs = [int(w.shape[0]) * int(w.shape[1]) for w in kernels]
  return 4 * sum(macs) + 2 * sum(macs[1:])


def _matmul_flops_per_sec(batch, width, repeats=20, rounds=5):
  import tensorflow as tf
  x = tf.random.normal([batch, width])
  w = tf.random.normal([width, width]) / width ** 0.5

  @tf.function
  def chain(x):
    for _ in tf.range(repeats):
      x = tf.matmul(x, w)
    return x

  chain(x).numpy()
  rates = []
  for _ in range(rounds):
    start = time.perf_counter()
    chain(x).numpy()
    rates.append(2 * batch * width * width * repeats /
                 (time.perf_counter() - start))
  return statistics.median(rates)


def main(argv):
  del argv
  from tfdist import run as run_lib
  logging.set_verbosity(logging.WARNING)
  small = inprocess.bench_config(model="mlp", synthetic_shape=(8, 8, 1),
                  batch_size=FLAGS.batch_size,
                  steps_per_loop=FLAGS.steps_per_loop)
  info = run_lib.start_tensorflow(small)
  import tensorflow as tf
  from tfdist import data
  dataset = data.load(small)
  jit = dataclasses.replace(small, jit_compile=True)
  contenders = {
      "tfdist": inprocess.tfdist_contender(small, info, dataset),
      "hand-written loop": _handwritten_contender(small, info, dataset),
      "keras fit, jit_compile=False": _fit_contender(small, info, dataset,
                                                     jit_compile=False),
      "tfdist --jit_compile": inprocess.tfdist_contender(jit, info, dataset),
      "keras fit, jit_compile=auto (XLA)": _fit_contender(small, info,
                                                          dataset),
  }
  steps = FLAGS.steps - FLAGS.steps % FLAGS.steps_per_loop
  rates = inprocess.measure(contenders, steps, FLAGS.rounds)
  print(f"\nSmall MLP 64-256-256-10, batch {small.batch_size}, "
        f"steps_per_loop {small.steps_per_loop}, {FLAGS.rounds} rounds of "
        f"{steps} steps, medians:")
  print("| contender | steps/s | tfdist / it | tfdist --jit_compile / it |")
  print("|---|---:|---:|---:|")
  for name, rate in rates.items():
    print(f"| {name} | {rate:.0f} | {rates['tfdist'] / rate:.3f} | "
          f"{rates['tfdist --jit_compile'] / rate:.3f} |")

  wide = inprocess.bench_config(model="mlp_wide", synthetic_shape=(32, 32, 1),
                 batch_size=FLAGS.flops_batch_size, steps_per_loop=10)
  wide_data = data.load(wide)
  trainer_run = inprocess.tfdist_contender(wide, info, wide_data)
  rate = inprocess.measure({"tfdist": trainer_run}, FLAGS.flops_steps,
                  FLAGS.rounds)["tfdist"]
  import models
  model = models.build("mlp_wide", input_shape=(32, 32, 1), num_classes=10)
  model(tf.zeros([1, 32, 32, 1]))  # Create the variables to count them.
  achieved = rate * wide.batch_size * _training_flops_per_example(model)
  peak = _matmul_flops_per_sec(wide.batch_size, 2048)
  print(f"\nWide MLP 1024-2048-2048-10, batch {wide.batch_size}:")
  print("| measure | GFLOP/s |")
  print("|---|---:|")
  print(f"| tfdist training | {achieved / 1e9:.1f} |")
  print(f"| raw tf.matmul {wide.batch_size}x2048x2048 | {peak / 1e9:.1f} |")
  print(f"| ratio | {achieved / peak:.3f} |")
  print(f"\nTensorFlow {tf.__version__}, {os.cpu_count()} CPUs.")


if __name__ == "__main__":
  app.run(main)
