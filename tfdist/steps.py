"""Strategy-agnostic loop functions: `steps_per_loop` steps per call.

Each replica carries its own running sums through the loop, and they are
reduced across replicas once per call, so a loop adds one small reduction on
top of the gradient all-reduce instead of one per step.
"""

import keras
import tensorflow as tf

SUM = tf.distribute.ReduceOp.SUM


def _per_example_loss(labels, logits):
  return keras.losses.sparse_categorical_crossentropy(
      labels, tf.cast(logits, tf.float32), from_logits=True)


def _correct(labels, logits, weights):
  hits = tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), labels)
  return tf.reduce_sum(tf.cast(hits, tf.float32) * weights)


class LoopFunctions:
  """Builds the train and eval loops for one model on one strategy."""

  def __init__(self, *, strategy, model, optimizer, global_batch_size,
               steps_per_loop, global_step, jit_compile=False):
    self._strategy = strategy
    self._model = model
    self._optimizer = optimizer
    self._global_batch_size = global_batch_size
    self._steps_per_loop = steps_per_loop
    self._global_step = global_step
    # XLA compiles a replica's forward and backward pass. The optimizer
    # update stays outside: under a multi-device strategy it all-reduces
    # across devices, which XLA cannot place.
    self._gradients = tf.function(self._forward_backward,
                                  jit_compile=jit_compile)
    self._eval_step_fn = tf.function(self._eval_step, jit_compile=jit_compile)
    self.train_loop = tf.function(self._train_loop)
    self.uncounted_train_loop = tf.function(self._uncounted_train_loop)
    self.eval_loop = tf.function(self._eval_loop)
    self.local_eval_loop = tf.function(self._local_eval_loop)

  def _train_zeros(self):
    return {"step_loss": tf.zeros([self._steps_per_loop]),
            "correct": tf.zeros([])}

  def _eval_zeros(self):
    return {"correct": tf.zeros([]), "examples": tf.zeros([]),
            "loss_sum": tf.zeros([])}

  def _forward_backward(self, images, labels, weights):
    model = self._model
    with tf.GradientTape() as tape:
      logits = model(images, training=True)
      per_example = _per_example_loss(labels, logits) * weights
      loss = tf.nn.compute_average_loss(
          per_example, global_batch_size=self._global_batch_size)
      if model.losses:
        loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
      scaled = self._optimizer.scale_loss(loss)
    return loss, logits, tape.gradient(scaled, model.trainable_variables)

  def _train_step(self, batch, sums, index):
    images, labels, weights = batch
    loss, logits, grads = self._gradients(images, labels, weights)
    variables = self._model.trainable_variables
    self._optimizer.apply_gradients(zip(grads, variables))
    return {
        "step_loss": tf.tensor_scatter_nd_add(sums["step_loss"], [[index]],
                                              [loss]),
        "correct": sums["correct"] + _correct(labels, logits, weights),
    }

  def _eval_step(self, batch, sums, index):
    del index
    images, labels, weights = batch
    logits = self._model(images, training=False)
    loss = tf.reduce_sum(_per_example_loss(labels, logits) * weights)
    return {
        "correct": sums["correct"] + _correct(labels, logits, weights),
        "examples": sums["examples"] + tf.reduce_sum(weights),
        "loss_sum": sums["loss_sum"] + loss,
    }

  def _run_loop(self, step_fn, zeros_fn, iterator, num_steps):
    run = self._strategy.run
    sums = run(zeros_fn)
    for index in tf.range(num_steps):
      sums = run(step_fn, args=(next(iterator), sums, index))
    return self._reduce(sums)

  def _reduce(self, sums):
    """One cross-replica reduction for all the sums: pack, reduce, unpack."""
    names = sorted(sums)
    packed = self._strategy.run(
        lambda s: tf.concat([tf.reshape(s[n], [-1]) for n in names], 0),
        args=(sums,))
    total = self._strategy.reduce(SUM, packed, axis=None)
    sizes = [self._steps_per_loop if n == "step_loss" else 1 for n in names]
    parts = tf.split(total, sizes)
    return {n: (p if n == "step_loss" else p[0]) for n, p in zip(names,
                                                                 parts)}

  def _uncounted_train_loop(self, iterator, num_steps):
    return self._run_loop(self._train_step, self._train_zeros, iterator,
                          num_steps)

  def _train_loop(self, iterator, num_steps):
    sums = self._uncounted_train_loop(iterator, num_steps)
    self.count_steps(num_steps)
    return sums

  def count_steps(self, num_steps):
    """Adds to the global step (atomic, even on a parameter server)."""
    self._global_step.assign_add(tf.cast(num_steps, tf.int64))

  def _local_eval_loop(self, iterator, num_steps):
    """Eval in this process without strategy.run (a PS coordinator)."""
    sums = self._eval_zeros()
    for index in tf.range(num_steps):
      sums = self._eval_step_fn(next(iterator), sums, index)
    return sums

  def _eval_loop(self, iterator, num_steps):
    return self._run_loop(self._eval_step_fn, self._eval_zeros, iterator,
                          num_steps)
