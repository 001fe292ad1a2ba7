"""Checks tfdist.collectives and tfdist.sharded_optimizer on one real
strategy, several cases in one process, and prints one line per case.

python tests/strategy_checks.py mirrored N CASE...     # N logical CPUs
python tests/strategy_checks.py multi_worker CASE...   # under a TF_CONFIG

CASE is `collectives`, `params:OPTIMIZER` or
`sharded:OPTIMIZER:CLIP_NORM[:BUCKET]` (BUCKET: elements per collective;
one bucket by default). One process runs
every case of a strategy: the logical CPUs are fixed at start-up, and a
process holds one MultiWorkerMirroredStrategy.

collectives: every replica holds its own random float32 vector of an odd
length (so the last shard is padded). The shard each replica gets from
reduce_scatter must be its rank's pieces of the all-reduced sum (piece r
of each bucket), and the all-gather of the shards must be that whole sum,
on every replica: in one bucket, and in buckets of 100 elements.

sharded: the same small model and batches train 8 steps on one device
(Keras's own apply) and with the sharded update on N replicas; the
weights, and every slot of each shard this process holds, must agree with
one device's (rtol 1e-5), while each replica holds 1/N of the state.

params:OPTIMIZER: the same with the weights sharded too
(tfdist.sharded_params), the model's whole weights released; and a model
with a layer called twice, BatchNorm and a block with dropout inside
against Keras's unsharded update on the same strategy.
"""

import sys

import numpy as np
import tensorflow as tf

LENGTH = 1001
BATCH, STEPS = 32, 8


def make_strategy(kind, replicas):
  """Before any other op runs (MultiWorkerMirrored needs it)."""
  if kind == "multi_worker":
    return tf.distribute.MultiWorkerMirroredStrategy()
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
  from tfdist import collectives  # pylint: disable=g-import-not-at-top
  return collectives.mirrored_with_collectives(
      [f"/cpu:{i}" for i in range(replicas)])


def check_collectives(strategy, bucket_elements):
  from tfdist import collectives  # pylint: disable=g-import-not-at-top
  shards = collectives.ShardCollectives(strategy, length=LENGTH,
                                        bucket_elements=bucket_elements)

  @tf.function
  def check():
    def replica_fn():
      context = tf.distribute.get_replica_context()
      mine = tf.random.stateless_normal(
          [LENGTH], seed=[7, context.replica_id_in_sync_group])
      total = context.all_reduce(tf.distribute.ReduceOp.SUM, mine)
      shard = shards.reduce_scatter(lambda start, end: tf.pad(
          mine, [[0, shards.num_buckets * shards.bucket - LENGTH]])[
              start:end])
      rank = shards.rank()
      padded = tf.pad(total, [[0, shards.num_buckets * shards.bucket -
                               LENGTH]])
      expected = tf.reshape(tf.reshape(padded, [
          shards.num_buckets, shards.num_shards, shards.piece])[:, rank],
                            [-1])
      return (tf.reduce_max(tf.abs(shard - expected)),
              tf.reduce_max(tf.abs(shards.all_gather(shard) - total)),
              rank)
    return strategy.run(replica_fn)

  shard_error, gather_error, ranks = (
      strategy.experimental_local_results(x) for x in check())
  worst = max(float(np.max(e)) for e in (*shard_error, *gather_error))
  assert worst < 1e-5, f"max error {worst}"
  print(f"collectives ok: {shards.num_shards} replicas, "
        f"{shards.num_buckets} bucket(s), shard_size {shards.shard_size}, "
        f"ranks {[int(r) for r in ranks]}, max error {worst:.2g}",
        flush=True)


def _model():
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(1)
  return keras.Sequential([keras.Input((8,)),
                           keras.layers.Dense(17, activation="relu"),
                           keras.layers.Dense(3)])


def _optimizer_factory(name):
  from tfdist import optimizers  # pylint: disable=g-import-not-at-top
  schedule = dict(schedule="cosine", learning_rate=0.02, warmup_steps=2,
                  decay_steps=6, end_learning_rate=0.0)
  return lambda: optimizers.create(
      name, schedule=schedule,
      weight_decay=0.01 if name == "adamw" else 0.0)


def _loss_fn():
  import keras  # pylint: disable=g-import-not-at-top
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction="none")


def _batches():
  rng = np.random.RandomState(0)
  return (rng.randn(STEPS, BATCH, 8).astype("float32"),
          rng.randint(0, 3, (STEPS, BATCH)))


def _one_device(make_optimizer, clip):
  """Keras's own update, clipped after the sum as tfdist does: the
  weights and the optimizer."""
  features, labels = _batches()
  loss_fn = _loss_fn()
  model, optimizer = _model(), make_optimizer()
  optimizer.build(model.trainable_variables)
  for k in range(STEPS):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(loss_fn(labels[k], model(features[k])))
    grads = tape.gradient(loss, model.trainable_variables)
    if clip:
      grads, _ = tf.clip_by_global_norm(grads, clip)
    optimizer.apply(grads, model.trainable_variables)
  return [v.numpy() for v in model.trainable_variables], optimizer


def _train_sharded(strategy, make_optimizer, clip, bucket_elements):
  from tfdist import sharded_optimizer  # pylint: disable=g-import-not-at-top
  features, labels = _batches()
  loss_fn = _loss_fn()
  replicas = strategy.num_replicas_in_sync
  with strategy.scope():
    model = _model()
  update = sharded_optimizer.ShardedUpdate(
      strategy=strategy, variables=model.trainable_variables,
      make_optimizer=make_optimizer, clip_norm=clip,
      bucket_elements=bucket_elements)

  @tf.function
  def step(x, y):
    def replica_fn(x, y):
      with tf.GradientTape() as tape:
        loss = tf.nn.compute_average_loss(loss_fn(y, model(x)),
                                          global_batch_size=BATCH)
      update.apply(tape.gradient(loss, model.trainable_variables))
      return loss
    share = BATCH // replicas
    inputs = strategy.experimental_distribute_values_from_function(
        lambda c: (x[c.replica_id_in_sync_group * share:][:share],
                   y[c.replica_id_in_sync_group * share:][:share]))
    return strategy.run(replica_fn, args=inputs)

  for k in range(STEPS):
    step(tf.constant(features[k]), tf.constant(labels[k]))
  return model, update


def _check_save_and_restore(update, reference_slots, per_variable):
  """What a checkpoint saves is each slot whole, as one device's; what a
  restore scatters gives each shard its pieces again."""
  from tfdist import sharded_optimizer  # pylint: disable=g-import-not-at-top
  before = [sharded_optimizer.slots(o)[k].numpy()
            for o in update.optimizers for k in range(per_variable)]
  with update.saving():
    for index, want in enumerate(reference_slots):
      got = update.whole_slot(index // per_variable, index % per_variable)
      np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5,
                                 atol=1e-7)
  for optimizer in update.optimizers:
    for slot in sharded_optimizer.slots(optimizer):
      slot.assign(tf.zeros_like(slot))
  update.restored = {(index // per_variable, index % per_variable):
                     want.numpy()
                     for index, want in enumerate(reference_slots)}
  update.scatter_restored()
  after = [sharded_optimizer.slots(o)[k].numpy()
           for o in update.optimizers for k in range(per_variable)]
  for got, want in zip(after, before):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def check_sharded(strategy, name, clip, bucket_elements):
  from tfdist import sharded_optimizer  # pylint: disable=g-import-not-at-top
  make_optimizer = _optimizer_factory(name)
  reference, optimizer = _one_device(make_optimizer, clip)
  reference_slots = sharded_optimizer.slots(optimizer)
  model, update = _train_sharded(strategy, make_optimizer, clip,
                                 bucket_elements)
  for got, want in zip(model.trainable_variables, reference):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
  replicas = strategy.num_replicas_in_sync
  slots_per_variable = len(reference_slots) // len(reference)
  for index in range(slots_per_variable):
    # Keras keeps each variable's slots together: [m0, v0, m1, v1, ...].
    flat_slot = np.concatenate([s.numpy().ravel() for s in
                                reference_slots[index::slots_per_variable]])
    flat_slot = np.pad(flat_slot,
                       [0, update.shard_size * replicas - flat_slot.size])
    for rank, shard_optimizer in zip(update.ranks(), update.optimizers):
      np.testing.assert_allclose(
          sharded_optimizer.slots(shard_optimizer)[index].numpy(),
          np.concatenate([flat_slot[start:end]
                          for start, end in update.owned(rank)]),
          rtol=1e-5, atol=1e-7)
  _check_save_and_restore(update, reference_slots, slots_per_variable)
  state = sum(v.numpy().nbytes for v in sharded_optimizer.slots(
      update.optimizers[0]))
  whole = sum(v.numpy().nbytes for v in reference_slots)
  print(f"sharded ok: {replicas} replicas, {name}, clip {clip:g}, "
        f"bucket {bucket_elements}, {slots_per_variable} slot(s), state "
        f"per replica {state} of {whole} bytes", flush=True)


def _layered_model():
  """A layer called twice; a nested model (its layers are units);
  BatchNorm statistics; integer inputs to an embedding; a layer given one
  tensor as two arguments, with two outputs; and a block whose dropout
  and BatchNorm inherit `training` from the model's call (its own call
  takes none), followed by a layer called with training=False: the
  backward's second run of each unit must see what the forward saw
  (mask, batch statistics)."""
  import keras  # pylint: disable=g-import-not-at-top

  class Block(keras.layers.Layer):
    def __init__(self):
      super().__init__()
      self.inner = keras.layers.Dense(8, activation="relu")
      self.norm = keras.layers.BatchNormalization()
      self.dropout = keras.layers.Dropout(0.5)
      self.outer = keras.layers.Dense(3)

    def call(self, x):
      return self.outer(self.dropout(self.norm(self.inner(x))))

  class Gate(keras.layers.Layer):
    def __init__(self):
      super().__init__()
      self.dense = keras.layers.Dense(8)

    def call(self, a, b):
      h = self.dense(a)
      return h * keras.ops.tanh(b), h

  class Tail(keras.layers.Layer):
    def __init__(self):
      super().__init__()
      self.dropout = keras.layers.Dropout(0.5)

    def call(self, x):
      return self.dropout(x, training=False)

  class ToIds(keras.layers.Layer):
    def call(self, x):
      return keras.ops.cast(keras.ops.abs(x[:, :2]) * 3, "int32") % 5

  keras.utils.set_random_seed(1)
  inputs = keras.Input((8,))
  embedded = keras.layers.Flatten()(
      keras.layers.Embedding(5, 4)(ToIds()(inputs)))
  shared = keras.layers.Dense(8, activation="tanh")
  # No bias before BatchNorm: its gradient is rounding noise, which Adam
  # scales up to a step.
  backbone = keras.Sequential([keras.Input((8,)),
                               keras.layers.Dense(8, use_bias=False),
                               keras.layers.BatchNormalization()])
  hidden = backbone(shared(shared(inputs)))
  gated, plain = Gate()(hidden, hidden)
  hidden = keras.layers.Concatenate()([gated, plain, embedded])
  # After the block, a layer that calls another with its own `training`:
  # Keras sets it on the call context the block's layers inherited from.
  # (A functional model passes its own `training` to its layers.)
  return keras.Model(inputs, Tail()(Block()(hidden)))


def _per_replica(strategy, x, y):
  share = BATCH // strategy.num_replicas_in_sync
  return strategy.experimental_distribute_values_from_function(
      lambda c: (x[c.replica_id_in_sync_group * share:][:share],
                 y[c.replica_id_in_sync_group * share:][:share]))


def _train_params(strategy, make_model, make_optimizer, prefetch=True,
                  reshard=True):
  """Sharded weights, released once sharded; the sharded state."""
  from tfdist import sharded_params  # pylint: disable=g-import-not-at-top
  features, labels = _batches()
  loss_fn = _loss_fn()
  with strategy.scope():
    model = make_model()
  sharded = sharded_params.ShardedParams(
      strategy=strategy, model=model, make_optimizer=make_optimizer,
      prefetch=prefetch, reshard=reshard)

  @tf.function
  def step(x, y):
    def replica_fn(x, y):
      with tf.GradientTape() as tape:
        with sharded.gathering():
          logits = model(x, training=True)
        loss = tf.nn.compute_average_loss(loss_fn(y, logits),
                                          global_batch_size=BATCH)
      sharded.apply(tape.gradient(loss, sharded.variables()))
      return loss
    return strategy.run(replica_fn, args=_per_replica(strategy, x, y))

  for k in range(STEPS):
    step(tf.constant(features[k]), tf.constant(labels[k]))
  return model, sharded


def _train_plain(strategy, make_model, make_optimizer):
  """Keras's own update on the same strategy, weights not sharded, each
  gradient dense."""
  features, labels = _batches()
  loss_fn = _loss_fn()
  with strategy.scope():
    model, optimizer = make_model(), make_optimizer()
    optimizer.build(model.trainable_variables)

  @tf.function
  def step(x, y):
    def replica_fn(x, y):
      with tf.GradientTape() as tape:
        loss = tf.nn.compute_average_loss(
            loss_fn(y, model(x, training=True)), global_batch_size=BATCH)
      # Dense, as the sharded update (and ZeRO-1) applies an embedding's
      # gradient: Keras updates IndexedSlices otherwise.
      grads = [tf.convert_to_tensor(g) for g in tape.gradient(
          loss, model.trainable_variables)]
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    return strategy.run(replica_fn, args=_per_replica(strategy, x, y))

  for k in range(STEPS):
    step(tf.constant(features[k]), tf.constant(labels[k]))
  return model


def check_params(strategy, name):
  """Fully sharded weights: a plain MLP gives one device's weights; a
  model with a shared layer, BatchNorm and dropout gives the unsharded
  run's weights and statistics on the same strategy."""
  from tfdist import released  # pylint: disable=g-import-not-at-top
  make_optimizer = _optimizer_factory(name)
  reference, _ = _one_device(make_optimizer, 0.0)
  _, sharded = _train_params(strategy, _model, make_optimizer)
  got = [w for unit in sharded.gathered_weights() for w in unit]
  for have, want in zip(got, reference, strict=True):
    np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
  local = sum(v.numpy().nbytes for v in (*sharded.shards[0],
                                         *sharded_slots(sharded)))
  plain = _train_plain(strategy, _layered_model, make_optimizer)
  # Prefetch on and off; the gathered weights dropped after the forward
  # (gathered again for the backward) and kept.
  for prefetch, reshard in ((True, True), (False, True), (True, False)):
    layered, layered_sharded = _train_params(
        strategy, _layered_model, make_optimizer, prefetch, reshard)
    got = [w for unit in layered_sharded.gathered_weights() for w in unit]
    held = {id(v) for v in released.held_weights(layered)}
    assert not held & {id(v) for v in layered.trainable_variables}, (
        "the whole weights are released")
    # The two models are built alike: their weights match by position.
    place = {id(v): i for i, v in enumerate(layered.trainable_variables)}
    units = [v for unit in layered_sharded.units for v in unit.weights]
    assert sorted(place[id(v)] for v in units) == list(range(len(place)))
    for have, variable in zip(got, units, strict=True):
      np.testing.assert_allclose(
          have, plain.trainable_variables[place[id(variable)]].numpy(),
          rtol=1e-5, atol=1e-6,
          err_msg=f"{variable.path}, prefetch {prefetch}, reshard {reshard}")
    for have, wanted in zip(layered.non_trainable_variables,
                            plain.non_trainable_variables, strict=True):
      np.testing.assert_allclose(have.numpy(), wanted.numpy(), rtol=1e-5,
                                 atol=1e-6, err_msg=have.path)
  whole = sum(w.nbytes for w in reference) * (
      1 + len(sharded_slots(sharded)) // len(sharded.shards[0]))
  assert len(sharded.shards[0]) == 2, "one unit per Dense layer"
  print(f"params ok: {strategy.num_replicas_in_sync} replicas, {name}, "
        f"state per replica {local} of {whole} bytes", flush=True)


def sharded_slots(sharded):
  from tfdist import sharded_optimizer  # pylint: disable=g-import-not-at-top
  return sharded_optimizer.slots(sharded.optimizers[0])


def main(argv):
  kind = argv[0]
  replicas = int(argv[1]) if kind == "mirrored" else 0
  cases = argv[2:] if kind == "mirrored" else argv[1:]
  strategy = make_strategy(kind, replicas)
  from tfdist import collectives  # pylint: disable=g-import-not-at-top
  for case in cases:
    if case == "collectives":
      for bucket_elements in (collectives.BUCKET_ELEMENTS, 100):
        check_collectives(strategy, bucket_elements)
    elif case.startswith("params:"):
      check_params(strategy, case.split(":")[1])
    else:
      _, name, clip, *bucket = case.split(":")
      check_sharded(strategy, name, float(clip), int(bucket[0]) if bucket
                    else collectives.BUCKET_ELEMENTS)


if __name__ == "__main__":
  main(sys.argv[1:])
