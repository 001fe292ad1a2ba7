"""A small transformer classifier: image rows become tokens."""

import keras


def _block(x, *, dim, heads, mlp_dim, name):
  y = keras.layers.LayerNormalization(name=f"{name}_ln1")(x)
  y = keras.layers.MultiHeadAttention(heads, dim // heads,
                                      name=f"{name}_attn")(y, y)
  x = keras.layers.Add(name=f"{name}_add1")([x, y])
  y = keras.layers.LayerNormalization(name=f"{name}_ln2")(x)
  y = keras.layers.Dense(mlp_dim, activation="gelu", name=f"{name}_mlp1")(y)
  y = keras.layers.Dense(dim, name=f"{name}_mlp2")(y)
  return keras.layers.Add(name=f"{name}_add2")([x, y])


class PositionEmbedding(keras.layers.Layer):
  """Adds a learned embedding per token position."""

  def build(self, input_shape):
    self.table = self.add_weight(
        shape=tuple(input_shape[1:]), name="table",
        initializer=keras.initializers.RandomNormal(stddev=0.02))

  def call(self, x):
    return x + keras.ops.cast(self.table, x.dtype)


def transformer(*, input_shape, num_classes, dim=64, heads=4, depth=2,
                mlp_dim=128):
  inputs = keras.Input(input_shape, name="images")
  rows, cols = input_shape[0], input_shape[1] * input_shape[2]
  x = keras.layers.Reshape((rows, cols))(inputs)
  x = keras.layers.Dense(dim, name="embed")(x)
  x = PositionEmbedding(name="position")(x)
  for index in range(depth):
    x = _block(x, dim=dim, heads=heads, mlp_dim=mlp_dim, name=f"block{index}")
  x = keras.layers.LayerNormalization(name="final_ln")(x)
  x = keras.layers.GlobalAveragePooling1D()(x)
  logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
  return keras.Model(inputs, logits, name="transformer")
