"""A user's own code, as tfdist has never seen it: a Keras functional model
with dict inputs (numeric columns plus an embedded categorical id),
trained as a regression, given three ways:
- `RegressionTask`, a tfdist.Task (--task=user_regression:RegressionTask);
- `build` (a compiled model) and `data` (--model=...:build
  --dataset=...:data);
- `Bad*` and `bad_*`: the bad-input cases the CLI must reject in one line.
"""

import keras
import numpy as np
import tensorflow as tf

import tfdist

NUM_EXAMPLES, NUM_EVAL, NUM_IDS = 512, 96, 7


def _examples(size, seed):
  rng = np.random.RandomState(seed)
  numeric = rng.normal(size=(size, 3)).astype(np.float32)
  ids = rng.randint(0, NUM_IDS, size=(size,)).astype(np.int32)
  target = (numeric @ np.array([[1.5], [-2.0], [0.5]], np.float32)
            + 0.3 * ids[:, None]).astype(np.float32)
  return {"numeric": numeric, "category": ids}, target


def data():
  """(train, eval): unbatched (features, labels) datasets."""
  train, test = _examples(NUM_EXAMPLES, 0), _examples(NUM_EVAL, 1)
  return (tf.data.Dataset.from_tensor_slices(train),
          tf.data.Dataset.from_tensor_slices(test))


def _model(outputs=1):
  numeric = keras.Input((3,), name="numeric")
  category = keras.Input((), dtype="int32", name="category")
  embedded = keras.layers.Embedding(NUM_IDS, 4, name="embed")(category)
  hidden = keras.layers.Concatenate()([numeric, embedded])
  hidden = keras.layers.Dense(16, activation="relu", name="hidden")(hidden)
  value = keras.layers.Dense(outputs, name="value")(hidden)
  return keras.Model({"numeric": numeric, "category": category}, value)


def build():
  """A compiled model: tfdist uses its loss (per example) and metrics."""
  model = _model()
  model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
  return model


class RegressionTask(tfdist.Task):
  name = "regression"

  def build_model(self):
    return _model()

  def datasets(self):
    return data()

  def loss(self, labels, outputs):
    return keras.losses.mean_squared_error(labels, outputs)

  def metrics(self):
    return [keras.metrics.MeanAbsoluteError(name="mae")]

  def serving_outputs(self, outputs):
    return {"value": outputs}


class TwoValueTask(RegressionTask):
  """The same body with a head of another shape (two outputs, the
  first one trained): a warm start from RegressionTask's checkpoint."""

  def build_model(self):
    return _model(outputs=2)

  def loss(self, labels, outputs):
    return keras.losses.mean_squared_error(labels, outputs[:, :1])


class NamedMetricTask(RegressionTask):
  """An eval metric whose name says nothing of its direction."""

  def metrics(self):
    return [keras.metrics.MeanAbsoluteError(name="score")]


class FullControlTask(RegressionTask):
  """Makes its own per-replica batches; it owns the input guarantees."""

  name = "full_control"

  def train_input(self, context, *, global_batch_size, seed, start_step):
    per_replica = context.get_per_replica_batch_size(global_batch_size)
    train, _ = data()
    train = train.shard(context.num_input_pipelines,
                        context.input_pipeline_id)
    return train.repeat().shuffle(64, seed=seed).batch(
        per_replica, drop_remainder=True).skip(start_step)

  def eval_input(self, context, *, global_batch_size):
    per_replica = context.get_per_replica_batch_size(global_batch_size)
    _, test = data()
    weighted = lambda f, y: (f, y, tf.ones_like(y[:, 0]))  # noqa: E731
    return test.batch(per_replica, drop_remainder=True).map(weighted)


class NoRepeatTask(FullControlTask):
  """Its train_input forgets .repeat(): 16 batches, then none."""

  def train_input(self, context, *, global_batch_size, seed, start_step):
    per_replica = context.get_per_replica_batch_size(global_batch_size)
    return data()[0].batch(per_replica, drop_remainder=True)


class EmptyInputTask(FullControlTask):
  """Its train_input has nothing in it (a filter that keeps nothing)."""

  def train_input(self, context, *, global_batch_size, seed, start_step):
    per_replica = context.get_per_replica_batch_size(global_batch_size)
    return data()[0].filter(lambda f, y: False).repeat().batch(per_replica)


class EndsMidRunTask(FullControlTask):
  """Ends after 16 batches, with a length TF cannot know in advance."""

  def train_input(self, context, *, global_batch_size, seed, start_step):
    per_replica = context.get_per_replica_batch_size(global_batch_size)
    return data()[0].filter(lambda f, y: True).batch(
        per_replica, drop_remainder=True)


# Bad input -------------------------------------------------------------

def bad_not_a_model():
  return [1, 2, 3]


def bad_features():
  """Features whose names do not match the model's inputs."""
  train, test = data()
  rename = lambda f, y: ({"numbers": f["numeric"], "id": f["category"]}, y)  # noqa: E731
  return train.map(rename), test.map(rename)


def bad_string_labels():
  train, test = data()
  as_text = lambda f, y: (f, tf.strings.as_string(y))  # noqa: E731
  return train.map(as_text), test.map(as_text)


class BadScalarLossTask(RegressionTask):

  def loss(self, labels, outputs):
    return tf.reduce_mean(tf.square(labels - outputs))
