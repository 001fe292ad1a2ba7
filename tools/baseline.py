"""The minimal hand-written training loop a TF engineer would write: the
baseline of tools.bench (in process) and tools.raw_mwms (multi-worker).

Forward, loss scaled by the global batch, backward, the optimizer's own
apply_gradients; `steps_per_loop` steps per tf.function call over
tf.range; no metrics.
"""

import keras
import tensorflow as tf


def loop_function(strategy, model, optimizer, global_batch_size):
  """A tf.function(iterator, num_steps) that trains num_steps steps on
  (images, labels) batches."""

  def step(batch):
    images, labels = batch[0], batch[1]
    with tf.GradientTape() as tape:
      loss = tf.nn.compute_average_loss(
          keras.losses.sparse_categorical_crossentropy(
              labels, model(images, training=True), from_logits=True),
          global_batch_size=global_batch_size)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  @tf.function
  def loop(iterator, num_steps):
    for _ in tf.range(num_steps):
      strategy.run(step, args=(next(iterator),))

  return loop
