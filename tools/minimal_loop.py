"""The minimal training loop, as a process of its own: the bar of
tools.bench_cli. Default strategy, a zoo model, Adam, random images cached
and repeated, `--steps_per_loop` steps per tf.function call
(tools.baseline), no metrics, no summaries, no checkpoints.

Prints "train step N/M" after each --log_every steps, as tfdist.train
does, so both are timed the same way by the reader of their output.
"""

import argparse


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--train_steps", type=int, default=1280)
  parser.add_argument("--batch_size", type=int, default=256)
  parser.add_argument("--steps_per_loop", type=int, default=32)
  parser.add_argument("--log_every", type=int, default=128)
  parser.add_argument("--model", default="mlp")
  args = parser.parse_args()

  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist import models  # pylint: disable=g-import-not-at-top
  from . import baseline  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.get_strategy()
  model = models.build(args.model, input_shape=(8, 8, 1), num_classes=10)
  model(tf.zeros([1, 8, 8, 1]))
  optimizer = keras.optimizers.Adam(1e-3)
  optimizer.build(model.trainable_variables)
  images = tf.random.stateless_uniform((1797, 8, 8, 1), (1, 1))
  labels = tf.random.stateless_uniform((1797,), (1, 2), maxval=10,
                                       dtype=tf.int32)
  dataset = tf.data.Dataset.from_tensor_slices((images, labels)).cache(
  ).repeat().batch(args.batch_size, drop_remainder=True).prefetch(-1)
  iterator = iter(dataset)
  loop = baseline.loop_function(strategy, model, optimizer, args.batch_size)
  done = 0
  while done < args.train_steps:
    size = min(args.steps_per_loop, args.train_steps - done)
    loop(iterator, tf.constant(size))  # Dispatched; runs asynchronously.
    done += size
    if done % args.log_every == 0 or done == args.train_steps:
      model.trainable_variables[0].numpy()  # Wait for the steps to end.
      print(f"train step {done}/{args.train_steps}", flush=True)


if __name__ == "__main__":
  main()
