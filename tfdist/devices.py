"""Device listing and variable byte counts, written once."""

import numpy as np


def local_devices():
  """Local GPUs if any, else the (logical) CPUs, by name."""
  import tensorflow as tf
  gpus = tf.config.list_logical_devices("GPU")
  return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def variable_bytes(variable):
  import tensorflow as tf
  return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size


def bytes_by(variables, key):
  """{key(variable): total bytes}, sorted by key."""
  totals = {}
  for variable in variables:
    name = key(variable)
    totals[name] = totals.get(name, 0) + variable_bytes(variable)
  return dict(sorted(totals.items()))
