"""Benchmark: what TF's distributed input iterator costs per train step.

taskset -c 0 python -m tools.bench_input [--rounds=3] [--steps=40]

One CPU device. The same Keras 3 MLP (mlp_wide's shape: 64-2048-2048-10,
Adam, batch 32) trains in a tf.range loop of strategy.run steps, fed three
ways, each in its own process (in one process, the distributed
iterator's threads slow the other contenders too), interleaved round by
round:
- mirrored, distributed: a one-device MirroredStrategy fed by
  distribute_datasets_from_function (what a hand-written MWMS loop uses,
  and tfdist on GPUs);
- mirrored, plain: the same strategy fed by a plain tf.data iterator, its
  batch passed to strategy.run (valid with one replica per process; what
  tfdist does on a CPU, runners.plain_input_context);
- default: no strategy, a plain iterator.
Each figure is the median over rounds [min-max]; each ratio is taken per
round, then summarized the same way. CPU seconds are the contender
process's own (user and system), per step.
"""

import resource
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 5, "Interleaved rounds per contender.")
flags.DEFINE_integer("steps", 40, "Train steps per round.")
flags.DEFINE_integer("batch_size", 32, "Batch.")
flags.DEFINE_string("contender", "", "Internal: run this one and print "
                    "its seconds per step.")

CONTENDERS = ("mirrored, distributed", "mirrored, plain", "default")


def _contender(name):
  """A compiled loop(num_steps) for one way of feeding the step."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  strategy = (tf.distribute.get_strategy() if name == "default" else
              tf.distribute.MirroredStrategy(["/cpu:0"]))
  with strategy.scope():
    model = keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(10)])
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
  features = tf.random.stateless_normal([1024, 64], (1, 2))
  labels = tf.random.stateless_uniform([1024], (3, 4), maxval=10,
                                       dtype=tf.int32)
  dataset = tf.data.Dataset.from_tensor_slices((features, labels)).repeat()
  dataset = dataset.batch(FLAGS.batch_size, drop_remainder=True)
  if name == "mirrored, distributed":
    iterator = iter(strategy.distribute_datasets_from_function(
        lambda context: dataset))
  else:
    iterator = iter(dataset)

  def step(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
          y, model(x, training=True), from_logits=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  @tf.function
  def loop(num_steps):
    total = tf.constant(0.0)
    for _ in tf.range(num_steps):
      loss = strategy.run(step, args=(next(iterator),))
      total += strategy.reduce("sum", loss, axis=None)
    return total

  loop(tf.constant(2)).numpy()  # Tracing.
  return loop


def _summary(values, unit=""):
  return (f"{statistics.median(values):.3f}{unit} "
          f"[{min(values):.3f}-{max(values):.3f}]")


def _run_contender(name):
  """Seconds per step of one contender in this process."""
  from tfdist import quiet  # pylint: disable=g-import-not-at-top
  with quiet.native_stderr_captured():
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    loop = _contender(name)
  start = time.perf_counter()
  loop(tf.constant(FLAGS.steps)).numpy()
  return (time.perf_counter() - start) / FLAGS.steps


def _in_child(name):
  """(wall, user CPU, system CPU) seconds per step of a contender in its
  own process."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  out = subprocess.run(
      [sys.executable, "-m", __spec__.name, f"--contender={name}",
       f"--steps={FLAGS.steps}", f"--batch_size={FLAGS.batch_size}"],
      capture_output=True, text=True, check=True).stdout
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  wall = float(out.split("seconds=")[1])
  # The child's CPU includes start-up and tracing; per timed step, only
  # the difference between contenders is meaningful.
  return (wall, (after.ru_utime - before.ru_utime) / FLAGS.steps,
          (after.ru_stime - before.ru_stime) / FLAGS.steps)


def main(argv):
  del argv
  if FLAGS.contender:
    print(f"seconds={_run_contender(FLAGS.contender)}")
    return 0
  found = {name: [] for name in CONTENDERS}
  for _ in range(FLAGS.rounds):
    for name in CONTENDERS:
      found[name].append(_in_child(name))
  base = [wall for wall, _, _ in found["mirrored, distributed"]]
  print(f"Adam MLP 64-2048-2048-10, batch {FLAGS.batch_size}, "
        f"{FLAGS.steps} steps x {FLAGS.rounds} rounds, one CPU device, "
        "one process per contender and round.")
  print("| feed | s/step | distributed / it, per round | process CPU "
        "user, system per step |")
  print("|---|---:|---:|---:|")
  for name in CONTENDERS:
    walls = [wall for wall, _, _ in found[name]]
    ratios = [b / w for b, w in zip(base, walls)]
    user = statistics.median(u for _, u, _ in found[name])
    system = statistics.median(s for _, _, s in found[name])
    print(f"| {name} | {_summary(walls)} | {_summary(ratios, 'x')} | "
          f"{user:.3f}, {system:.3f} |")
  return 0


if __name__ == "__main__":
  app.run(main)
