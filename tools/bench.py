"""Benchmark: tfdist's loop against a hand-written loop and Keras fit.

python -m tools.bench [--rounds=7] [--steps=640] [--steps_per_loop=32]

Contenders run interleaved, round by round, in one process, on the same
model, data, optimizer and strategy. Every rate and every ratio (taken per
round, between neighbours in time) is printed as median [min-max].
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

from . import baseline
from . import inprocess

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 7, "Interleaved rounds per contender.")
flags.DEFINE_integer("steps", 640, "Training steps per round (small MLP).")
flags.DEFINE_integer("steps_per_loop", 32, "Steps per tf.function call.")
flags.DEFINE_integer("batch_size", 256, "Global batch (small MLP).")
flags.DEFINE_integer("flops_steps", 20, "Steps per round (wide MLP).")
flags.DEFINE_integer("flops_batch_size", 512, "Global batch (wide MLP).")
flags.DEFINE_list("parts", ["small", "wide"], "Which parts to run.")


def _handwritten_contender(config, info, dataset):
  """The minimal loop a TF engineer would write by hand (tools.baseline)."""
  import keras
  import tensorflow as tf
  from tfdist import data
  from tfdist import models
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
  loop = baseline.loop_function(strategy, model, optimizer,
                                config.batch_size)

  def run(steps):
    for _ in range(steps // config.steps_per_loop):
      loop(iterator, tf.constant(config.steps_per_loop))
    # Wait for the last step: read a weight.
    model.trainable_variables[0].numpy()
  return run


def _fit_contender(config, info, dataset, jit_compile="auto",
                   metrics=("accuracy",)):
  import keras
  from tfdist import data
  from tfdist import models
  with info.strategy.scope():
    model = models.build(config.model, input_shape=dataset.input_shape,
                         num_classes=dataset.num_classes)
    model.compile(optimizer=keras.optimizers.Adam(config.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  metrics=list(metrics),
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


def _matmul_flops_per_sec(batch, width, repeats=20, rounds=3):
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
  logging.set_verbosity(logging.WARNING)
  small = inprocess.bench_config(model="mlp", synthetic_shape=(8, 8, 1),
                                 batch_size=FLAGS.batch_size,
                                 steps_per_loop=FLAGS.steps_per_loop)
  info = inprocess.start(small)
  import tensorflow as tf
  if "small" in FLAGS.parts:
    _small(small, info)
  if "wide" in FLAGS.parts:
    _wide(info)
  print(f"\nTensorFlow {tf.__version__}, {os.cpu_count()} CPUs.")


def _small(small, info):
  from tfdist import data
  dataset = data.load(small)
  jit = dataclasses.replace(small, jit_compile=True)
  contenders = {
      "tfdist": inprocess.tfdist_contender(small, info),
      "hand-written loop (no metrics)": _handwritten_contender(
          small, info, dataset),
      "keras fit, jit_compile=False, accuracy metric": _fit_contender(
          small, info, dataset, jit_compile=False),
      "keras fit, jit_compile=False, no metrics": _fit_contender(
          small, info, dataset, jit_compile=False, metrics=()),
      "keras fit, jit_compile=auto (XLA), accuracy metric": _fit_contender(
          small, info, dataset),
      "tfdist --jit_compile": inprocess.tfdist_contender(jit, info),
  }
  steps = FLAGS.steps - FLAGS.steps % FLAGS.steps_per_loop
  rates = inprocess.measure(contenders, steps, FLAGS.rounds)
  print(f"\nSmall MLP 64-256-256-10, batch {small.batch_size}, "
        f"steps_per_loop {small.steps_per_loop}, {FLAGS.rounds} interleaved "
        f"rounds of {steps} steps; median [min-max] over rounds:")
  print("| contender | steps/s | tfdist / it, per round |")
  print("|---|---:|---:|")
  for name, rate in rates.items():
    ratios = [a / b for a, b in zip(rates["tfdist"], rate)]
    print(f"| {name} | {inprocess.spread(rate)} | "
          f"{inprocess.spread(ratios, '{:.3f}')} |")


def _wide(info):
  import tensorflow as tf
  from tfdist import data
  from tfdist import models
  wide = inprocess.bench_config(model="mlp_wide", synthetic_shape=(32, 32, 1),
                                batch_size=FLAGS.flops_batch_size,
                                steps_per_loop=10)
  runs = inprocess.measure(
      {"tfdist": inprocess.tfdist_contender(wide, info),
       "hand-written": _handwritten_contender(wide, info, data.load(wide))},
      FLAGS.flops_steps, FLAGS.rounds)
  wide_rates = runs["tfdist"]
  model = models.build("mlp_wide", input_shape=(32, 32, 1), num_classes=10)
  model(tf.zeros([1, 32, 32, 1]))  # Create the variables to count them.
  flops = wide.batch_size * _training_flops_per_example(model)
  peaks = [_matmul_flops_per_sec(wide.batch_size, 2048)
           for _ in range(FLAGS.rounds)]
  achieved = [rate * flops for rate in wide_rates]
  print(f"\nWide MLP 1024-2048-2048-10, batch {wide.batch_size}; median "
        "[min-max]:")
  print("| measure | GFLOP/s |")
  print("|---|---:|")
  print(f"| tfdist training | {inprocess.spread([a / 1e9 for a in achieved], '{:.1f}')} |")
  print(f"| raw tf.matmul {wide.batch_size}x2048x2048 | "
        f"{inprocess.spread([p / 1e9 for p in peaks], '{:.1f}')} |")
  print(f"| hand-written loop training | "
        f"{inprocess.spread([r * flops / 1e9 for r in runs['hand-written']], '{:.1f}')} |")
  print(f"| tfdist / raw matmul, per round | "
        f"{inprocess.spread([a / p for a, p in zip(achieved, peaks)], '{:.3f}')} |")
  print(f"| hand-written / raw matmul, per round | "
        f"{inprocess.spread([r * flops / p for r, p in zip(runs['hand-written'], peaks)], '{:.3f}')} |")


if __name__ == "__main__":
  app.run(main)
