"""The Task contract: what a user gives tfdist to train their own model.

A Task builds a Keras model, gives unbatched (features, labels) or
(features, labels, sample_weight) datasets, a per-example loss and Keras
metrics. tfdist does the rest: shuffling,
epochs, host sharding, per-replica batching, resume, exact eval, the
distribution strategy, checkpoints, summaries and the export.

    class MyTask(tfdist.Task):
      def build_model(self): ...           # a keras.Model
      def datasets(self): ...              # (train, eval) tf.data.Datasets
      def loss(self, labels, outputs): ... # per-example loss, shape [batch]
      def metrics(self): ...               # [keras.metrics.Metric, ...]
      # Or, for a loss that needs more than (labels, outputs):
      def compute_loss(self, model, features, labels, training): ...

A task that needs full control of its input instead defines
`train_input(context, *, global_batch_size, seed, start_step)` and
`eval_input(context, *, global_batch_size)`, returning per-replica batches like `distribute_datasets_from_function`'s
input functions ((features, labels[, sample_weight]) and (features,
labels, mask[, sample_weight]), the mask 0 on padding examples). It
then owns the guarantees tfdist gives for its own pipeline: the same global
batch on any number of hosts, no repeats after a resume, exact eval; and
--eval_steps must say how many eval batches there are.

The zoo and the built-in datasets are one such task, ClassificationTask.
"""

import importlib
import inspect
import os
import sys

from tfdist import errors
from tfdist.errors import ConfigError


class Task:
  """Subclass this; override build_model, datasets, and usually loss and
  metrics. The default loss and metric are those of classification with
  integer labels and logits."""

  # Names the task in logs and checkpoints; the class name if None.
  name = None

  def build_model(self):
    raise NotImplementedError("a Task must define build_model()")

  def datasets(self):
    """(train, eval): unbatched tf.data.Datasets of (features, labels),
    or of (features, labels, sample_weight) for per-example weights with
    Keras's meaning (each split on its own)."""
    raise NotImplementedError("a Task must define datasets() (or "
                              "train_input and eval_input)")

  def loss(self, labels, outputs):
    return classification_loss(labels, outputs)

  def metrics(self):
    import keras
    return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]

  def compute_loss(self, model, features, labels, training):
    """The per-example loss of a batch (shape [batch]), or (that loss, the
    outputs the metrics see). Override it when the loss needs more than
    (labels, outputs): distillation from a frozen teacher (build it in
    build_model, so it lives under the strategy, and keep it out of the
    model), auxiliary losses, several outputs. Returning the loss alone
    makes the metrics run the model once more. The default: the model's
    outputs and self.loss."""
    outputs = model(features, training=training)
    return self.loss(labels, outputs), outputs

  def serving_outputs(self, outputs):
    """The named outputs of the export's serving signature."""
    if isinstance(outputs, dict):
      return dict(outputs)
    return {"outputs": outputs}

  # Internal: what tfdist reads. ------------------------------------------

  @property
  def display_name(self):
    return self.name or type(self).__name__

  def data(self):
    """The datasets as a tfdist.data.Dataset (counted once)."""
    return _as_dataset(self.datasets(), f"{self.display_name}.datasets()")

  @property
  def controls_input(self):
    return callable(getattr(self, "train_input", None))


def classification_loss(labels, logits):
  import keras
  import tensorflow as tf
  return keras.losses.sparse_categorical_crossentropy(
      labels, tf.cast(logits, tf.float32), from_logits=True)


def classification_outputs(logits):
  import tensorflow as tf
  logits = tf.cast(logits, tf.float32)
  return {"logits": logits, "probabilities": tf.nn.softmax(logits),
          "classes": tf.argmax(logits, axis=-1, output_type=tf.int32)}


class ClassificationTask(Task):
  """A zoo model (or a user's model) on image-classification data."""

  def __init__(self, *, model, dataset, partitioner=None,
               tensor_parallel_devices=None):
    self._model = model  # A zoo name, or a function returning a model.
    self._dataset = dataset  # A tfdist.data.Dataset with input_shape set.
    self._partitioner = partitioner
    self._tensor_parallel_devices = tensor_parallel_devices
    self.name = model if isinstance(model, str) else getattr(
        model, "__name__", "model")

  def build_model(self):
    from tfdist import models
    if not isinstance(self._model, str):
      return self._model()
    return models.build(
        self._model, input_shape=self._dataset.input_shape,
        num_classes=self._dataset.num_classes, partitioner=self._partitioner,
        tensor_parallel_devices=self._tensor_parallel_devices)

  def data(self):
    return self._dataset

  @property
  def num_classes(self):
    return self._dataset.num_classes

  def serving_outputs(self, outputs):
    return classification_outputs(outputs)


class KerasModelTask(Task):
  """--model=module:function: a user's Keras model. A compiled model
  brings its loss (made per-example) and metrics; otherwise the
  classification loss and accuracy apply."""

  def __init__(self, *, model_fn, spec, dataset):
    self._model_fn = model_fn
    self._spec = spec
    self._dataset = dataset
    self._loss_fn = None
    self._metric_specs = None
    self.name = spec

  def build_model(self):
    import keras
    model = self._model_fn()
    if not isinstance(model, keras.Model):
      raise ConfigError(f"--model={self._spec} returned a "
                        f"{type(model).__name__}, not a keras.Model.")
    if getattr(model, "compiled", False) and model.loss is not None:
      self._loss_fn = _per_example_loss(model.loss, self._spec)
      config = getattr(model, "_compile_config", None)
      self._metric_specs = list(
          (config.config.get("metrics") if config else None) or [])
    return model

  def data(self):
    return self._dataset

  def loss(self, labels, outputs):
    if self._loss_fn is None:
      return classification_loss(labels, outputs)
    return self._loss_fn(labels, outputs)

  def metrics(self):
    if self._metric_specs is None:
      return super().metrics()
    return [_metric(spec, self._loss_fn) for spec in self._metric_specs]


def _per_example_loss(loss, spec):
  """The compiled loss without reduction, so that tfdist scales it by the
  global batch as every strategy needs."""
  import keras
  if isinstance(loss, (dict, list, tuple)):
    raise ConfigError(f"--model={spec} is compiled with several losses; "
                      "tfdist takes one. Write a Task whose loss() combines "
                      "them.")
  if isinstance(loss, keras.losses.Loss):
    config = {**loss.get_config(), "reduction": None}
    return type(loss).from_config(config)
  if isinstance(loss, str):
    return keras.losses.get(loss)  # The function form: per example.
  if callable(loss):
    return loss
  raise ConfigError(f"--model={spec} has a loss tfdist cannot use: "
                    f"{loss!r}")


def _metric(spec, loss_fn):
  import copy
  import keras
  if isinstance(spec, keras.metrics.Metric):
    return copy.deepcopy(spec)  # Fresh state, same configuration.
  if spec in ("accuracy", "acc"):
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__).lower()
    if "sparse" in name:
      return keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    if "binary" in name:
      return keras.metrics.BinaryAccuracy(name="accuracy")
    return keras.metrics.CategoricalAccuracy(name="accuracy")
  try:
    metric = keras.metrics.get(spec)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"metric {spec!r} is unknown to Keras: {e}") from None
  # Named as given ("mae"), as Keras's fit names it.
  return type(metric).from_config({**metric.get_config(), "name": spec})


# Naming user code: package.module:Name ----------------------------------

def is_reference(value):
  return ":" in value


def import_object(reference, *, flag):
  """Imports `module:name` from the current directory or PYTHONPATH."""
  module_name, _, attribute = reference.partition(":")
  if not module_name or not attribute:
    raise ConfigError(f"--{flag} takes package.module:name. Received: "
                      f"{flag}={reference}")
  if os.getcwd() not in sys.path and "" not in sys.path:
    sys.path.insert(0, os.getcwd())
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # The user's module may raise anything.
    first = errors.first_line(e, 200, empty="")
    raise ConfigError(f"--{flag}={reference}: cannot import {module_name!r} "
                      f"({type(e).__name__}: {first})") from None
  target = module
  for part in attribute.split("."):
    if not hasattr(target, part):
      raise ConfigError(f"--{flag}={reference}: module {module_name!r} has "
                        f"no {attribute!r}")
    target = getattr(target, part)
  return target


def call_user(function, *, flag, reference):
  """Calls a user's function, turning its exceptions into one line."""
  try:
    return function()
  except ConfigError:
    raise
  except Exception as e:  # The user's code may raise anything.
    first = errors.first_line(e, 200, empty="")
    raise ConfigError(f"--{flag}={reference} failed: {type(e).__name__}: "
                      f"{first}") from None


def load_task(reference):
  """--task=module:Name: a Task subclass or instance, or a function
  returning one."""
  target = import_object(reference, flag="task")
  if inspect.isclass(target) and issubclass(target, Task):
    task = call_user(target, flag="task", reference=reference)
  elif isinstance(target, Task):
    task = target
  elif callable(target):
    task = call_user(target, flag="task", reference=reference)
  else:
    task = target
  if not isinstance(task, Task):
    raise ConfigError(f"--task={reference} gave a {type(task).__name__}, "
                      "not a tfdist.Task.")
  if task.name is None:
    task.name = reference
  return task


def user_dataset(reference, known_counts=None):
  """--dataset=module:function returning a FileData or (train, eval);
  `known_counts`: record counts an earlier run kept."""
  function = import_object(reference, flag="dataset")
  return _as_dataset(call_user(function, flag="dataset", reference=reference),
                     f"--dataset={reference}", known_counts)


def _as_dataset(returned, name, known_counts=None):
  """A tfdist.data.Dataset from what a user's function `name` returned: a
  tfdist.FileData or (train, eval) tf.data.Datasets."""
  from tfdist import data
  if isinstance(returned, data.FileData):
    return data.file_dataset(returned, name, known_counts)
  if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
    raise ConfigError(f"{name} must return a tfdist.FileData or (train, "
                      "eval) tf.data.Datasets. Received: a "
                      f"{type(returned).__name__}")
  return data.from_user(name, *returned)


def _with_classification_shape(dataset):
  """A user dataset given to a zoo model: its input shape and classes."""
  import dataclasses
  from absl import logging
  import tensorflow as tf
  from tfdist import data
  spec = data.features_spec(dataset)
  if not isinstance(spec, tf.TensorSpec) or not spec.shape.is_fully_defined():
    raise ConfigError(f"a zoo model needs one fixed-shape feature tensor; "
                      f"{dataset.name} gives {spec}. Use --model=module:fn "
                      "or a Task.")
  if dataset.num_classes is not None:
    return dataclasses.replace(dataset, input_shape=tuple(spec.shape))
  if not dataset.in_memory:
    logging.warning("a zoo model needs the number of classes: reading every "
                    "label of %s once to find it. Return "
                    "tfdist.FileData(..., num_classes=N) to start without "
                    "this pass.", dataset.name)
  labels = dataset.train_source().map(lambda _, y: tf.cast(y, tf.int64))
  top = int(labels.reduce(tf.constant(0, tf.int64), tf.maximum))
  return dataclasses.replace(dataset, input_shape=tuple(spec.shape),
                             num_classes=top + 1)


def from_config(config, *, partitioner=None, tensor_parallel_devices=None):
  """The task a Config names: --task, else --model with --dataset."""
  from tfdist import data
  from tfdist import models
  if config.task:
    return load_task(config.task)
  # The model's module first: a typo fails before any data is read.
  if is_reference(config.model):
    function = import_object(config.model, flag="model")
  else:
    models.check_name(config.model)
  if is_reference(config.dataset):
    from tfdist import checkpoints  # pylint: disable=g-import-not-at-top
    dataset = user_dataset(config.dataset, checkpoints.kept_record_counts(
        config.model_dir))
  else:
    dataset = data.load(config)
  if is_reference(config.model):
    return KerasModelTask(
        model_fn=lambda: call_user(function, flag="model",
                                   reference=config.model),
        spec=config.model, dataset=dataset)
  if dataset.input_shape is None:
    dataset = _with_classification_shape(dataset)
  return ClassificationTask(model=config.model, dataset=dataset,
                            partitioner=partitioner,
                            tensor_parallel_devices=tensor_parallel_devices)
