"""Raw TensorFlow MultiWorkerMirrored training, no tfdist: the baseline of
tools.bench_allreduce and of tools.netlab's `raw` config. Run one process
per task with TF_CONFIG set, e.g. through
`python -m launch.local --workers=2 --module=tools.raw_mwms`.

What a TF engineer writes from the MWMS tutorial: the same zoo model
(--model), Adam, the global batch and steps per tf.function call as the
tfdist contender, TF's distributed input iterator, and Keras's own
gradient all-reduce in apply_gradients (one pack, after the backward
pass). TF reads TF_CONFIG itself. Prints "train step N/M" every
--log_every steps, as tfdist.train does, for the lab to sample.
"""

import argparse
import time


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--train_steps", type=int, required=True)
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--steps_per_loop", type=int, default=50)
  parser.add_argument("--log_every", type=int, default=0)
  parser.add_argument("--model", default="mlp")
  args, _ = parser.parse_known_args()  # Callers add tfdist flags too.

  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist import models  # pylint: disable=g-import-not-at-top
  from . import baseline  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
      communication_options=tf.distribute.experimental.CommunicationOptions(
          implementation=tf.distribute.experimental.CommunicationImplementation
          .RING))
  with strategy.scope():
    model = models.build(args.model, input_shape=(8, 8, 1), num_classes=10)
    model(tf.zeros([1, 8, 8, 1]))
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)

  def dataset_fn(context):
    images = tf.random.stateless_uniform((1024, 8, 8, 1), (1, 1))
    labels = tf.random.stateless_uniform((1024,), (1, 2), maxval=10,
                                         dtype=tf.int32)
    per_replica = context.get_per_replica_batch_size(args.batch_size)
    return tf.data.Dataset.from_tensor_slices((images, labels)).repeat(
    ).batch(per_replica, drop_remainder=True).prefetch(-1)

  iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
  loop = baseline.loop_function(strategy, model, optimizer, args.batch_size)
  # Calls of log_every steps, so each progress line ends a call.
  per_call = args.log_every or args.steps_per_loop
  start, done = time.monotonic(), 0
  while done < args.train_steps:
    size = min(per_call, args.train_steps - done)
    loop(iterator, tf.constant(size))
    done += size
    if args.log_every:
      model.trainable_variables[0].numpy()  # Wait for the call to end.
      print(f"train step {done}/{args.train_steps} "
            f"({time.monotonic() - start:.1f}s)", flush=True)
  model.trainable_variables[0].numpy()


if __name__ == "__main__":
  main()
