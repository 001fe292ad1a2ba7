"""Readers for what a run leaves in model_dir: checkpoints and events."""

import glob
import os

import numpy as np
import tensorflow as tf
from tensorboard.plugins.hparams import plugin_data_pb2


# The first trainable kernel. The checkpoint's object graph names each
# variable by its shortest path, which for trainable weights runs through
# the optimizer.
FIRST_KERNEL = "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"
_BOOKKEEPING = ("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter/")


def model_weights(model_dir, *, checkpoint=None):
  """{key: array} of every variable in the latest checkpoint (or the one
  given): the model's weights, the optimizer's slots and the step (not the
  save counter)."""
  path = checkpoint or tf.train.latest_checkpoint(model_dir)
  reader = tf.train.load_checkpoint(path)
  weights = {key: reader.get_tensor(key)
             for key in reader.get_variable_to_shape_map()
             if not key.startswith(_BOOKKEEPING)}
  assert FIRST_KERNEL in weights, sorted(weights)
  return weights


def checkpoint_step(model_dir):
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
  return int(reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE"))


def scalars(log_dir, tag, *, in_time_order=False):
  """[(step, value)] of a scalar summary in every event file of log_dir
  (on any filesystem tf.io.gfile reads: ram:// too), sorted by step, or
  by the time written (a resumed run writes a step again)."""
  points = []
  pattern = f"{str(log_dir).rstrip('/')}/events.out.*"
  for path in sorted(tf.io.gfile.glob(pattern)):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == tag:
          points.append((event.wall_time, event.step,
                         float(tf.make_ndarray(value.tensor))))
  points.sort(key=(lambda point: point[0]) if in_time_order else
              (lambda point: point[1:]))
  return [point[1:] for point in points]


def summary_tags(log_dir):
  tags = set()
  for path in glob.glob(os.path.join(log_dir, "events.out.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(value.tag for value in event.summary.value)
  return tags


def assert_weights_close(actual, expected, rtol):
  assert sorted(actual) == sorted(expected)
  for key in expected:
    np.testing.assert_allclose(actual[key], expected[key], rtol=rtol,
                               atol=1e-7, err_msg=key)


def hparams(log_dir):
  """The HParams a run logged for TensorBoard's HParams dashboard, as
  {name: value}; {} if none."""
  for path in glob.glob(os.path.join(log_dir, "events.out.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.metadata.plugin_data.plugin_name == "hparams":
          data = plugin_data_pb2.HParamsPluginData.FromString(
              value.metadata.plugin_data.content)
          if data.HasField("session_start_info"):
            return {name: getattr(v, v.WhichOneof("kind"))
                    for name, v in data.session_start_info.hparams.items()}
  return {}


def variables_by_name(checkpoint_path):
  """{variable name: array} of a checkpoint, from its object graph (the
  keys are object paths; the names say which variable is which)."""
  from tensorflow.core.protobuf import trackable_object_graph_pb2  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(checkpoint_path)
  graph = trackable_object_graph_pb2.TrackableObjectGraph()
  graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
  found = {}
  for node in graph.nodes:
    for attribute in node.attributes:
      if attribute.name == "VARIABLE_VALUE":
        found[attribute.full_name] = reader.get_tensor(
            attribute.checkpoint_key)
  return found
