"""The compiled train and eval steps of one task on one strategy.

Each replica carries its running sums through a `tf.range` loop of
`steps_per_loop` steps, and the sums are reduced across replicas once per
call, packed into one vector: a call adds one small reduction on top of the
gradient all-reduce, not one per step. Per step a replica adds its loss to
a sum, keeps the index of its first non-finite loss, and updates the task's
metrics statelessly; that is all it does besides forward, backward and the
update.

How these loops are called on each kind of strategy lives in
tfdist.runners; the packed vector's layout in tfdist.loop_wire, and the
gradient all-reduce (its packs, their order, PowerSGD's start step) in
tfdist.compression.
"""

import contextlib
import numpy as np
import tensorflow as tf

from tfdist import compression
from tfdist import loop_wire
from tfdist import task as task_lib
from tfdist.errors import ConfigError

SUM = tf.distribute.ReduceOp.SUM
# The steps below have no Python control flow on tensors, and Keras code
# (models, losses, metrics, optimizers) is written to run without autograph;
# converting it all cost ~2 s of start-up per run. Only the tf.range loops
# in train_steps/eval_steps need autograph.
_PLAIN = tf.autograph.experimental.do_not_convert


class Metrics:
  """A task's Keras metrics, updated statelessly and reduced as sums."""

  def __init__(self, metrics, *, example=None):
    """`example`: (labels, outputs) of a few examples, to build metrics
    that create their state on first use."""
    self._metrics = list(metrics)
    for metric in self._metrics:
      if not metric.variables and example is not None:
        metric.update_state(*_with_example_axis(*example))
        metric.reset_state()
    names = [m.name for m in self._metrics]
    if len(set(names)) != len(names) or {"loss", "examples"} & set(names):
      raise ConfigError(f"metric names must be unique and not 'loss' or "
                        f"'examples'. Received: {names}")
    for metric in self._metrics:
      for variable in metric.variables:
        if variable.aggregation != "sum":
          raise ConfigError(
              f"metric {metric.name!r} keeps state {variable.path} with "
              f"aggregation={variable.aggregation!r}; tfdist reduces metric "
              "state exactly only when it is summed.")
    self.initial = [[np.array(v.numpy()) for v in m.variables]
                    for m in self._metrics]
    self.names = names

  def zeros(self):
    return [[tf.constant(value) for value in state] for state in self.initial]

  def update(self, states, labels, outputs, sample_weight=None):
    labels, outputs = _with_example_axis(labels, outputs)
    return [list(metric.stateless_update_state(
        state, labels, outputs, sample_weight=sample_weight))
            for metric, state in zip(self._metrics, states)]

  def results(self, states):
    values = {}
    for metric, state in zip(self._metrics, states):
      result = metric.stateless_result(
          [tf.constant(v) for v in state])
      values[metric.name] = float(np.asarray(result))
    return values

  def sizes(self):
    return [[int(np.prod(v.shape)) for v in state] for state in self.initial]


def _with_example_axis(labels, outputs):
  """Rank-1 outputs (a squeezed head, one value per example) and their
  labels get a last axis of size 1, so that a Keras loss or metric, which
  reduces the last axis, gives one value per example, as in Keras `fit`."""
  if not (isinstance(outputs, tf.Tensor) and outputs.shape.rank == 1):
    return labels, outputs
  if isinstance(labels, tf.Tensor) and labels.shape.rank == 1:
    labels = labels[:, None]
  return labels, outputs[:, None]


def loss_and_outputs(task, model, features, labels, training):
  """(per-example loss, outputs) of a batch: the task's loss on the
  model's outputs, or its own compute_loss."""
  if type(task).compute_loss is task_lib.Task.compute_loss:
    outputs = model(features, training=training)
    return per_example_loss(task, labels, outputs), outputs
  result = task.compute_loss(model, features, labels, training)
  if isinstance(result, (tuple, list)) and len(result) == 2:
    loss, outputs = result
  else:
    loss, outputs = result, model(features, training=training)
  return _checked_per_example(task, tf.convert_to_tensor(loss)), outputs


def per_example_loss(task, labels, outputs):
  """The task's loss, checked to be per example ([batch] or more)."""
  return _checked_per_example(task,
                              task.loss(*_with_example_axis(labels, outputs)))


def _checked_per_example(task, loss):
  if loss.shape.rank == 0:
    raise ConfigError(
        f"{task.display_name}'s loss returned a scalar; tfdist needs the "
        "per-example loss (shape [batch]) to scale it by the global batch. "
        "Use a Keras loss with reduction=None.")
  loss = tf.cast(loss, tf.float32)
  if loss.shape.rank > 1:
    loss = tf.reduce_mean(loss, axis=list(range(1, loss.shape.rank)))
  return loss


def _identity_in_place(tensor):
  with tf.device(tensor.device):
    return tf.identity(tensor)


class LoopFunctions:
  """Builds the replica steps and the loops over them."""

  def __init__(self, *, strategy, model, optimizer, task, metrics,
               global_batch_size, steps_per_loop, global_step,
               grad_accum_steps=1, clip_norm=0.0, reducer=None,
               jit_compile="none", class_weight=None, sharded=None,
               measure_input_wait=True):
    """`class_weight`: {class: weight} for integer labels, as Keras `fit`
    has it (training only; classes not in it weigh 1). `sharded`: a
    sharded_optimizer.ShardedUpdate or a sharded_params.ShardedParams,
    which then reduces, clips and applies the gradients in place of the
    reducer and the optimizer (and gives the step its variables and the
    context of its forward pass)."""
    self._sharded = sharded
    # The input wait reads a weight after each update: local on
    # synchronous strategies, an RPC on parameter servers.
    self._measure_input_wait = measure_input_wait and bool(
        model.trainable_variables)
    self._strategy = strategy
    self._model = model
    self._optimizer = optimizer
    self._task = task
    self.metrics = metrics
    self.wire = loop_wire.LoopWire(metrics=metrics,
                                   steps_per_loop=steps_per_loop)
    self._global_batch_size = global_batch_size
    self._steps_per_loop = steps_per_loop
    self._global_step = global_step
    self._accum = grad_accum_steps
    self._clip_norm = clip_norm
    self._class_weight = class_weight
    self.reducer = reducer or compression.PlainReducer()
    # The step all-reduces its gradients itself (compression, clipping
    # after the reduction), so the optimizer must not do it again.
    compression.take_over_reduction(optimizer)
    # "step": XLA compiles the whole replica step, optimizer update
    # included (one replica per process). "forward": only forward and
    # backward (several replicas: the update all-reduces across devices,
    # which XLA cannot place).
    self._gradients = (tf.function(self._forward_backward, jit_compile=True)
                       if jit_compile == "forward" else self._forward_backward)
    self.train_step = (tf.function(self._train_step, jit_compile=True)
                       if jit_compile == "step" else self._train_step)
    self.eval_step = (tf.function(self._eval_step, jit_compile=True)
                      if jit_compile != "none" else self._eval_step)

  # Replica steps ---------------------------------------------------------

  def _step_variables(self):
    """What the step differentiates (in a replica context)."""
    if self._sharded:
      return self._sharded.step_variables()
    return self._model.trainable_variables

  def _forward(self):
    return self._sharded.forward() if self._sharded else (
        contextlib.nullcontext())

  def _train_weights(self, labels, sample_weight):
    """Each example's weight: its sample_weight times its class weight;
    None when both are absent (all 1)."""
    if not self._class_weight:
      return sample_weight
    # Classes past the largest one given weigh 1, like those left out.
    table = [1.0] * (max(self._class_weight) + 2)
    for label, weight in self._class_weight.items():
      table[label] = weight
    index = tf.minimum(tf.reshape(tf.cast(labels, tf.int32), [-1]),
                       len(table) - 1)
    weights = tf.gather(tf.constant(table, tf.float32), index)
    return weights if sample_weight is None else weights * sample_weight

  @_PLAIN
  def _forward_backward(self, features, labels, sample_weight,
                        metric_states):
    model = self._model
    with tf.GradientTape() as tape, self._forward():
      per_example, outputs = loss_and_outputs(self._task, model, features,
                                              labels, training=True)
      # Keras's sample_weight: the weighted sum over the global batch,
      # divided by the global batch size.
      loss = tf.nn.compute_average_loss(
          per_example, sample_weight=sample_weight,
          global_batch_size=self._global_batch_size)
      if model.losses:
        loss += tf.nn.scale_regularization_loss(
            tf.add_n(model.losses)) / self._accum
      scaled = self._optimizer.scale_loss(loss)
    grads = tape.gradient(scaled, self._step_variables())
    return loss, grads, self.metrics.update(metric_states, labels, outputs,
                                            sample_weight=sample_weight)

  @_PLAIN
  def _accumulated(self, features, labels, sample_weight, metric_states):
    """K micro-batches one after another (a while loop, so only one
    micro-batch's activations are alive at a time); gradients summed."""
    k = self._accum

    def micro(structure, i):
      if structure is None:  # No sample weights (tf.nest maps None too).
        return None
      return tf.nest.map_structure(
          lambda t: tf.reshape(t, tf.concat([[k, -1], tf.shape(t)[1:]], 0))[i],
          structure)

    zeros = [tf.zeros_like(v) for v in self._step_variables()]
    # Variables the loss does not reach have None gradients, as without
    # accumulation: found when the body is traced (once).
    unreached = set()

    def body(i, loss, grads, states):
      step_loss, step_grads, states = self._gradients(
          micro(features, i), micro(labels, i), micro(sample_weight, i),
          states)
      summed = []
      for index, (total, grad) in enumerate(zip(grads, step_grads)):
        if grad is None:
          unreached.add(index)
          summed.append(total)
        else:  # An IndexedSlices gradient is added densely here.
          summed.append(total + tf.convert_to_tensor(grad))
      return i + 1, loss + step_loss, summed, states

    _, loss, grads, states = tf.while_loop(
        lambda i, *_: i < k, body,
        (tf.constant(0), tf.constant(0.0), zeros, metric_states),
        parallel_iterations=1)
    grads = [None if index in unreached else grad
             for index, grad in enumerate(grads)]
    return loss, grads, states

  @_PLAIN
  def _train_step(self, batch, state, index, compressed=False):
    features, labels, *sample_weight = batch
    weights = self._train_weights(
        labels, tf.cast(sample_weight[0], tf.float32) if sample_weight
        else None)
    if self._accum > 1:
      loss, grads, metric_states = self._accumulated(features, labels,
                                                     weights, state.metrics)
    else:
      loss, grads, metric_states = self._gradients(features, labels,
                                                   weights, state.metrics)
    if self._sharded:
      self._sharded.apply(grads)
    else:
      grads = self.reducer.reduce(grads, compressed)
      if self._clip_norm:
        grads, _ = tf.clip_by_global_norm(grads, self._clip_norm)
      self._optimizer.apply_gradients(
          zip(grads, self._model.trainable_variables))
    first = tf.where((state.first_nonfinite < 0) &
                     tf.logical_not(tf.math.is_finite(loss)),
                     index, state.first_nonfinite)
    # The loss sum waits for the update (a read of the first layer's
    # weights, whose gradient backprop computes last, is ordered after
    # their assignment), so that the next input wait starts after it.
    updated = ([tf.identity(self._step_variables()[0])]
               if self._measure_input_wait else [])
    with tf.control_dependencies(updated):
      return loop_wire.TrainState(state.loss + loss, first, metric_states)

  @_PLAIN
  def _eval_step(self, batch, state):
    # mask: 0 on padding. As in Keras's evaluate, the loss is the weighted
    # sum over the real examples divided by their number; metrics weigh
    # each example by its sample_weight.
    features, labels, mask, *sample_weight = batch
    with self._forward():
      per_example, outputs = loss_and_outputs(
          self._task, self._model, features, labels, training=False)
    mask = tf.cast(mask, tf.float32)
    weights = mask * tf.cast(sample_weight[0], tf.float32) if (
        sample_weight) else mask
    return loop_wire.EvalState(
        state.loss + tf.cast(tf.reduce_sum(per_example * weights),
                             tf.float64),
        state.examples + tf.reduce_sum(tf.cast(mask, tf.float64)),
        self.metrics.update(state.metrics, labels, outputs,
                            sample_weight=weights))

  @_PLAIN
  def train_zeros(self):
    return loop_wire.TrainState(tf.constant(0.0), tf.constant(-1, tf.int32),
                      self.metrics.zeros())

  @_PLAIN
  def eval_zeros(self):
    return loop_wire.EvalState(tf.constant(0.0, tf.float64),
                     tf.constant(0.0, tf.float64), self.metrics.zeros())

  # Loops (traced inside a runner's tf.function) --------------------------

  def train_steps(self, iterator, num_steps, compressed, stop):
    """`num_steps` replica steps; returns the packed, reduced sums.
    `compressed` (a Python bool, so a second trace) picks the reducer's
    compressed all-reduce. `stop` (a float tensor, 1 after SIGTERM) rides
    in the reduced vector."""
    run = self._strategy.run
    state = run(self.train_zeros)
    waited = tf.constant(0.0 if self._measure_input_wait else np.nan,
                         tf.float64)
    for index in tf.range(num_steps):
      if self._measure_input_wait:
        batch, wait = self._timed_next(iterator, state)
        waited += wait
      else:
        batch = next(iterator)
      state = run(self.train_step, args=(batch, state, index, compressed))
    reduced = self._reduce(self.wire.pack_train, state, stop)
    return tf.concat([reduced, tf.reshape(tf.cast(waited, reduced.dtype),
                                          [1])], 0)

  def _timed_next(self, iterator, state):
    """The next batch and the seconds spent waiting for it, from the end
    of the step before it (its loss sum, `state`, waits for its update)."""
    with tf.control_dependencies(tf.nest.flatten(state,
                                                 expand_composites=True)):
      before = tf.timestamp()
    with tf.control_dependencies([before]):
      batch = next(iterator)
    with tf.control_dependencies(tf.nest.flatten(batch,
                                                 expand_composites=True)):
      after = tf.timestamp()
    # The step waits for the second stamp: one inter-op thread could
    # otherwise run the whole step before it.
    with tf.control_dependencies([after]):
      batch = tf.nest.map_structure(_identity_in_place, batch,
                                    expand_composites=True)
    return batch, after - before

  def eval_steps(self, iterator, num_steps, stop):
    run = self._strategy.run
    state = run(self.eval_zeros)
    for _ in tf.range(num_steps):
      state = run(self.eval_step, args=(next(iterator), state))
    return self._reduce(self.wire.pack_eval, state, stop)

  def count_steps(self, num_steps):
    """Adds to the global step (atomic, even on a parameter server)."""
    self._global_step.assign_add(tf.cast(num_steps, tf.int64))

  def _reduce(self, pack, state, stop):
    packed = self._strategy.run(pack, args=(state, stop))
    return self._strategy.reduce(SUM, packed, axis=None)
