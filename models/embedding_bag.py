"""An embedding-bag classifier with a big table, for sharded-PS training.

Each pixel becomes a categorical token: (position, its grey level, its right
neighbour's grey level), 17 levels each. The 8x8 digits give 64 * 17 * 17 =
18,496 tokens; a 64-wide float32 table is 4.7 MB, which a partitioner splits
into shards, one per ps task.

Keras 3 variables cannot wrap tf.distribute's ShardedVariable (gradients
fail on its missing `handle`), so ShardedEmbedding holds one Keras variable
per shard; ParameterServerStrategy places consecutive variables on
consecutive ps tasks.
"""

import keras
import tensorflow as tf

LEVELS = 17


class PixelTokens(keras.layers.Layer):
  """Image in [0, 1] -> one token id per pixel."""

  def call(self, images):
    levels = keras.ops.cast(keras.ops.round(images[..., 0] * (LEVELS - 1)),
                            "int32")
    right = keras.ops.concatenate([levels[:, :, 1:], levels[:, :, :1]],
                                  axis=2)
    rows, cols = levels.shape[1], levels.shape[2]
    position = keras.ops.reshape(keras.ops.arange(rows * cols, dtype="int32"),
                                 (1, rows, cols))
    ids = (position * LEVELS + levels) * LEVELS + right
    return keras.ops.reshape(ids, (-1, rows * cols))


class ShardedEmbedding(keras.layers.Layer):
  """An embedding table split row-wise ("mod") into `num_shards` variables."""

  def __init__(self, vocab, dim, *, num_shards=1, **kwargs):
    super().__init__(**kwargs)
    if num_shards < 1 or num_shards > vocab:
      raise ValueError(f"num_shards must be in 1..vocab. Received: "
                       f"num_shards={num_shards} for vocab={vocab}")
    self.vocab, self.dim, self.num_shards = vocab, dim, num_shards

  def build(self, input_shape):
    del input_shape
    # Shard i holds ids i, i + n, i + 2n, ...: the "mod" strategy of
    # tf.nn.embedding_lookup.
    self.shards = [
        self.add_weight(
            shape=(len(range(i, self.vocab, self.num_shards)), self.dim),
            initializer=keras.initializers.RandomUniform(-0.05, 0.05),
            name=f"shard_{i}_of_{self.num_shards}")
        for i in range(self.num_shards)]

  def call(self, ids):
    return tf.nn.embedding_lookup([s.value for s in self.shards], ids)


def embedding_bag(*, input_shape, num_classes, dim=64, partitioner=None):
  inputs = keras.Input(input_shape, name="images")
  tokens = PixelTokens(name="tokens")(inputs)
  vocab = input_shape[0] * input_shape[1] * LEVELS * LEVELS
  num_shards = 1
  if partitioner is not None:
    num_shards = partitioner(tf.TensorShape([vocab, dim]), tf.float32)[0]
  x = ShardedEmbedding(vocab, dim, num_shards=num_shards,
                       name="embedding")(tokens)
  x = keras.layers.GlobalAveragePooling1D()(x)
  x = keras.layers.Dense(128, activation="relu", name="dense")(x)
  logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
  return keras.Model(inputs, logits, name="embedding_bag")
