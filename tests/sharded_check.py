"""Checks tfdist.sharded_optimizer against one device and prints one line.

python tests/sharded_check.py N OPTIMIZER CLIP_NORM   # mirrored, N CPUs
python tests/sharded_check.py 0 OPTIMIZER CLIP_NORM   # MWMS, TF_CONFIG

The same small model and batches train 8 steps on one device (Keras's own
apply) and with the sharded update on N replicas; the weights, and every
slot of each shard this process holds, must agree with one device's
(rtol 1e-5), while each replica holds 1/N of the state.
"""

import sys

import numpy as np
import tensorflow as tf

N, OPTIMIZER, CLIP = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
if N:
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * N)
  STRATEGY = None
else:  # Before any other op runs.
  STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # pylint: disable=g-import-not-at-top,wrong-import-position

from tfdist import collectives  # pylint: disable=wrong-import-position
from tfdist import optimizers  # pylint: disable=wrong-import-position
from tfdist import sharded_optimizer  # pylint: disable=wrong-import-position

BATCH, STEPS = 32, 8


def make_model():
  keras.utils.set_random_seed(1)
  return keras.Sequential([keras.Input((8,)),
                           keras.layers.Dense(17, activation="relu"),
                           keras.layers.Dense(3)])


def make_optimizer():
  schedule = dict(schedule="cosine", learning_rate=0.02, warmup_steps=2,
                  decay_steps=6, end_learning_rate=0.0)
  return optimizers.create(OPTIMIZER, schedule=schedule,
                           weight_decay=0.01 if OPTIMIZER == "adamw" else 0.0)


rng = np.random.RandomState(0)
features = rng.randn(STEPS, BATCH, 8).astype("float32")
labels = rng.randint(0, 3, (STEPS, BATCH))
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                     reduction="none")

# One device, Keras's own update (clipped after the sum, as tfdist does).
model, optimizer = make_model(), make_optimizer()
optimizer.build(model.trainable_variables)
for k in range(STEPS):
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(loss_fn(labels[k], model(features[k])))
  grads = tape.gradient(loss, model.trainable_variables)
  if CLIP:
    grads, _ = tf.clip_by_global_norm(grads, CLIP)
  optimizer.apply(grads, model.trainable_variables)
reference = [v.numpy() for v in model.trainable_variables]
reference_slots = sharded_optimizer.slots(optimizer)

strategy = STRATEGY or collectives.mirrored_with_collectives(
    [f"/cpu:{i}" for i in range(N)])
N = strategy.num_replicas_in_sync
with strategy.scope():
  sharded_model = make_model()
update = sharded_optimizer.ShardedUpdate(
    strategy=strategy, variables=sharded_model.trainable_variables,
    make_optimizer=make_optimizer, clip_norm=CLIP)


@tf.function
def step(x, y):
  def replica_fn(x, y):
    with tf.GradientTape() as tape:
      loss = tf.nn.compute_average_loss(loss_fn(y, sharded_model(x)),
                                        global_batch_size=BATCH)
    update.apply(tape.gradient(loss, sharded_model.trainable_variables))
    return loss
  share = BATCH // N
  inputs = strategy.experimental_distribute_values_from_function(
      lambda c: (x[c.replica_id_in_sync_group * share:][:share],
                 y[c.replica_id_in_sync_group * share:][:share]))
  return strategy.run(replica_fn, args=inputs)


for k in range(STEPS):
  step(tf.constant(features[k]), tf.constant(labels[k]))
for got, want in zip(sharded_model.trainable_variables, reference):
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
slots_per_variable = len(reference_slots) // len(reference)
for index in range(slots_per_variable):
  # Keras keeps each variable's slots together: [m0, v0, m1, v1, ...].
  flat_slot = np.concatenate([s.numpy().ravel() for s in
                              reference_slots[index::slots_per_variable]])
  flat_slot = np.pad(flat_slot, [0, update.shard_size * N - flat_slot.size])
  for rank, shard_optimizer in zip(update.ranks(), update.optimizers):
    np.testing.assert_allclose(
        sharded_optimizer.slots(shard_optimizer)[index].numpy(),
        flat_slot[rank * update.shard_size:][:update.shard_size],
        rtol=1e-5, atol=1e-7)
state = sum(v.numpy().nbytes for v in sharded_optimizer.slots(
    update.optimizers[0]))
whole = sum(v.numpy().nbytes for v in reference_slots)
print(f"sharded ok: {N} replicas, {OPTIMIZER}, clip {CLIP:g}, "
      f"{slots_per_variable} slot(s), state per replica {state} of {whole} "
      "bytes")
