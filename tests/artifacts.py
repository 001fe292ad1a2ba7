"""Readers for what a run leaves in model_dir: checkpoints and events."""

import glob
import os

import numpy as np
import tensorflow as tf


def model_weights(model_dir):
  """{checkpoint key: array} for the model's variables at the latest step."""
  path = tf.train.latest_checkpoint(model_dir)
  reader = tf.train.load_checkpoint(path)
  return {key: reader.get_tensor(key)
          for key in reader.get_variable_to_shape_map()
          if key.startswith("model/")}


def checkpoint_step(model_dir):
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
  return int(reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE"))


def scalars(log_dir, tag):
  """[(step, value)] of a scalar summary in every event file of log_dir."""
  points = []
  for path in sorted(glob.glob(os.path.join(log_dir, "events.out.*"))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == tag:
          points.append((event.step,
                         float(tf.make_ndarray(value.tensor))))
  return sorted(points)


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
