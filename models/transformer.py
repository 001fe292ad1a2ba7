"""A small transformer classifier: image rows become tokens.

Built as a chain of blocks (embed, block0..N-1, head) so that a pipeline
can place them on stages; with tensor_parallel_devices each block's
attention heads and MLP are split Megatron-style (two reductions a block).
"""

import keras

from .parallel_layers import SelfAttention
from .parallel_layers import TensorParallelMLP


class TokenEmbed(keras.layers.Layer):
  """(rows, cols, channels) image -> rows tokens of `dim`, plus positions."""

  def __init__(self, dim, **kwargs):
    super().__init__(**kwargs)
    self.dim = dim
    self.project = keras.layers.Dense(dim, name="project")

  def build(self, input_shape):
    self.project.build((None, input_shape[1],
                        input_shape[2] * input_shape[3]))
    self.position = self.add_weight(
        shape=(input_shape[1], self.dim), name="position",
        initializer=keras.initializers.RandomNormal(stddev=0.02))

  def compute_output_shape(self, input_shape):
    return (input_shape[0], input_shape[1], self.dim)

  def call(self, images):
    shape = keras.ops.shape(images)
    tokens = keras.ops.reshape(images, (shape[0], shape[1],
                                        shape[2] * shape[3]))
    x = self.project(tokens)
    return x + keras.ops.cast(self.position, x.dtype)


class TransformerBlock(keras.layers.Layer):
  """Pre-norm self-attention and MLP, each with a residual."""

  def __init__(self, *, dim, heads, mlp_dim, tensor_parallel_devices=None,
               **kwargs):
    super().__init__(**kwargs)
    self.norm1 = keras.layers.LayerNormalization(name="ln1")
    self.attention = SelfAttention(
        dim, heads, devices=tensor_parallel_devices or [None],
        name="attention")
    self.norm2 = keras.layers.LayerNormalization(name="ln2")
    if tensor_parallel_devices:
      self.mlp = TensorParallelMLP(mlp_dim, dim,
                                   devices=tensor_parallel_devices,
                                   inner_activation="gelu", name="mlp")
    else:
      self.mlp = keras.Sequential([
          keras.layers.Dense(mlp_dim, activation="gelu", name="mlp1"),
          keras.layers.Dense(dim, name="mlp2")], name="mlp")

  def build(self, input_shape):
    # Built eagerly, sublayer by sublayer, so no layer is built while Keras
    # traces shapes in a scratch graph.
    self.norm1.build(input_shape)
    self.attention.build(input_shape)
    self.norm2.build(input_shape)
    self.mlp.build(input_shape)

  def compute_output_shape(self, input_shape):
    return input_shape

  def call(self, x):
    x = x + self.attention(self.norm1(x))
    return x + self.mlp(self.norm2(x))


class ClassifierHead(keras.layers.Layer):

  def __init__(self, num_classes, **kwargs):
    super().__init__(**kwargs)
    self.norm = keras.layers.LayerNormalization(name="final_ln")
    self.logits = keras.layers.Dense(num_classes, dtype="float32",
                                     name="logits")

  def build(self, input_shape):
    self.norm.build(input_shape)
    self.logits.build((input_shape[0], input_shape[-1]))

  def compute_output_shape(self, input_shape):
    return (input_shape[0], self.logits.units)

  def call(self, x):
    return self.logits(keras.ops.mean(self.norm(x), axis=1))


def transformer(*, input_shape, num_classes, dim=64, heads=4, depth=2,
                mlp_dim=128, tensor_parallel_devices=None):
  del input_shape  # The chain builds on its first call.
  blocks = [TokenEmbed(dim, name="embed")]
  blocks += [TransformerBlock(dim=dim, heads=heads, mlp_dim=mlp_dim,
                              tensor_parallel_devices=tensor_parallel_devices,
                              name=f"block{i}") for i in range(depth)]
  blocks.append(ClassifierHead(num_classes, name="head"))
  return keras.Sequential(blocks, name="transformer")
