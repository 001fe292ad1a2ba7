"""Megatron-style tensor-parallel layers on explicit devices.

Column-parallel Dense: the kernel's output columns are split over K
devices; each computes its slice of the output, and the slices are joined
by concatenation (an all-gather). Row-parallel Dense: the kernel's input
rows are split; each device multiplies its slice of the INPUT by its rows,
and the partial results are summed (an all-reduce). A column split joined
by a sum would be wrong: the sum belongs to the row-parallel form, whose
input is split too.

An MLP built from the pair needs one reduction: the column layer's output
shards feed the row layer directly, with the activation applied per shard.

Each layer creates its full kernel with the same initializer call a Dense
would make and slices it, so with the same seed a split model starts from
exactly the weights of the unsplit one.
"""

import keras
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.placement import on


def _slice_initializer(value):
  return lambda shape, dtype=None: keras.ops.cast(value, dtype)


def _check_divides(width, devices, what):
  if width % len(devices):
    raise ConfigError(
        f"tensor_parallel={len(devices)} must divide the {what} width. "
        f"Received: width={width} for tensor_parallel={len(devices)}")


class ColumnParallelDense(keras.layers.Layer):
  """y = act(x @ W + b) with W's columns split; returns shards or concat."""

  def __init__(self, units, *, devices, activation=None, gather_output=True,
               **kwargs):
    super().__init__(**kwargs)
    self.units, self.devices = units, list(devices)
    self.activation = keras.activations.get(activation)
    self.gather_output = gather_output
    _check_divides(units, self.devices, f"{self.name} output")
    # Made here, as Dense makes its own, so seeds are drawn in the same order.
    self.kernel_initializer = keras.initializers.GlorotUniform()

  def build(self, input_shape):
    full = self.kernel_initializer((input_shape[-1], self.units))
    width = self.units // len(self.devices)
    self.kernels, self.biases = [], []
    for k, device in enumerate(self.devices):
      with on(device):
        self.kernels.append(self.add_weight(
            shape=(input_shape[-1], width), name=f"kernel_{k}",
            initializer=_slice_initializer(full[:, k * width:(k + 1) * width])))
        self.biases.append(self.add_weight(shape=(width,), name=f"bias_{k}",
                                           initializer="zeros"))

  def call(self, x):
    shards = []
    for device, kernel, bias in zip(self.devices, self.kernels, self.biases):
      with on(device):
        shards.append(self.activation(keras.ops.matmul(x, kernel) + bias))
    return keras.ops.concatenate(shards, axis=-1) if self.gather_output \
        else shards


class RowParallelDense(keras.layers.Layer):
  """y = act(sum_k x_k @ W_k + b), x split along its last axis."""

  def __init__(self, units, *, devices, activation=None, **kwargs):
    super().__init__(**kwargs)
    self.units, self.devices = units, list(devices)
    self.activation = keras.activations.get(activation)
    self.kernel_initializer = keras.initializers.GlorotUniform()

  def build(self, input_shape):
    # A list of K shards, or one tensor that is split here.
    shape = input_shape[0] if isinstance(input_shape, list) else input_shape
    total = shape[-1] * (len(input_shape) if isinstance(input_shape, list)
                         else 1)
    _check_divides(total, self.devices, f"{self.name} input")
    full = self.kernel_initializer((total, self.units))
    rows = total // len(self.devices)
    self.kernels = []
    for k, device in enumerate(self.devices):
      with on(device):
        self.kernels.append(self.add_weight(
            shape=(rows, self.units), name=f"kernel_{k}",
            initializer=_slice_initializer(full[k * rows:(k + 1) * rows])))
    with on(self.devices[0]):
      self.bias = self.add_weight(shape=(self.units,), name="bias",
                                  initializer="zeros")

  def call(self, x):
    shards = x if isinstance(x, list) else keras.ops.split(
        x, len(self.devices), axis=-1)
    partials = []
    for device, kernel, shard in zip(self.devices, self.kernels, shards):
      with on(device):
        partials.append(keras.ops.matmul(shard, kernel))
    with on(self.devices[0]):  # The one reduction of the pair.
      return self.activation(tf.add_n(partials) + self.bias)


class SelfAttention(keras.layers.Layer):
  """Multi-head self-attention whose heads are split over `devices`.

  Q, K and V are column-parallel with head-aligned shards, so each device
  attends with its own heads; the output projection is row-parallel over
  those heads: one reduction per layer. With one device (`[None]`) it is
  plain attention, and the split form starts from the same weights.
  """

  def __init__(self, dim, heads, *, devices=(None,), **kwargs):
    super().__init__(**kwargs)
    self.devices = list(devices)
    if heads % len(self.devices):
      raise ConfigError(
          f"tensor_parallel={len(self.devices)} must divide the attention "
          f"heads. Received: heads={heads} for "
          f"tensor_parallel={len(self.devices)}")
    self.dim, self.heads, self.head_dim = dim, heads, dim // heads
    self.query, self.key, self.value = (
        ColumnParallelDense(dim, devices=self.devices, gather_output=False,
                            name=name) for name in ("query", "key", "value"))
    self.output_projection = RowParallelDense(dim, devices=self.devices,
                                              name="output")

  def build(self, input_shape):
    for projection in (self.query, self.key, self.value):
      projection.build(input_shape)
    shard = tuple(input_shape[:-1]) + (self.dim // len(self.devices),)
    self.output_projection.build([shard] * len(self.devices))

  def compute_output_shape(self, input_shape):
    return input_shape

  def _attend(self, q, k, v):
    shape = keras.ops.shape(q)
    heads = q.shape[-1] // self.head_dim

    def split_heads(x):
      x = keras.ops.reshape(x, (shape[0], shape[1], heads, self.head_dim))
      return keras.ops.transpose(x, (0, 2, 1, 3))

    q, k, v = split_heads(q), split_heads(k), split_heads(v)
    scores = keras.ops.matmul(q, keras.ops.transpose(k, (0, 1, 3, 2)))
    weights = keras.ops.softmax(scores / self.head_dim ** 0.5, axis=-1)
    out = keras.ops.transpose(keras.ops.matmul(weights, v), (0, 2, 1, 3))
    return keras.ops.reshape(out, (shape[0], shape[1], heads * self.head_dim))

  def call(self, x):
    queries, keys, values = self.query(x), self.key(x), self.value(x)
    heads = []
    for device, q, k, v in zip(self.devices, queries, keys, values):
      with on(device):
        heads.append(self._attend(q, k, v))
    return self.output_projection(heads)


class TensorParallelMLP(keras.layers.Layer):
  """Dense(hidden, inner) -> Dense(units, outer), split over devices with a
  single all-reduce."""

  def __init__(self, hidden, units, *, devices, inner_activation,
               outer_activation=None, **kwargs):
    super().__init__(**kwargs)
    self.column = ColumnParallelDense(hidden, devices=devices,
                                      activation=inner_activation,
                                      gather_output=False,
                                      name=f"{self.name}_column")
    self.row = RowParallelDense(units, devices=devices,
                                activation=outer_activation,
                                name=f"{self.name}_row")

  def build(self, input_shape):
    # Built here, eagerly, so the sliced initial values are real tensors.
    self.column.build(input_shape)
    shard = tuple(input_shape[:-1]) + (
        self.column.units // len(self.column.devices),)
    self.row.build([shard] * len(self.column.devices))

  def compute_output_shape(self, input_shape):
    return tuple(input_shape[:-1]) + (self.row.units,)

  def call(self, x):
    return self.row(self.column(x))
