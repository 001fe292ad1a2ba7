"""Raw TensorFlow MultiWorkerMirrored training, no tfdist: the baseline of
tools.bench_allreduce. Run one process per task with TF_CONFIG set, e.g.
through `python -m launch.local --workers=2 --module=tools.raw_mwms`.

Same model (MLP 64-256-256-10), optimizer (Adam), global batch and steps
per tf.function call as the tfdist contender; TF reads TF_CONFIG itself.
"""

import argparse


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--train_steps", type=int, required=True)
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--steps_per_loop", type=int, default=50)
  args, _ = parser.parse_known_args()  # tools.jobs adds tfdist flags.

  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from . import baseline  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
      communication_options=tf.distribute.experimental.CommunicationOptions(
          implementation=tf.distribute.experimental.CommunicationImplementation
          .RING))
  with strategy.scope():
    model = keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
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

  done = 0
  while done < args.train_steps:
    size = min(args.steps_per_loop, args.train_steps - done)
    loop(iterator, tf.constant(size))
    done += size
  model.trainable_variables[0].numpy()


if __name__ == "__main__":
  main()
