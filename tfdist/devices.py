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


def _short_name(device):
  """'CPU:1', or 'ps1/CPU:0' for a device of another task."""
  import tensorflow as tf
  spec = tf.DeviceSpec.from_string(device)
  name = f"{spec.device_type}:{spec.device_index}"
  if spec.job and spec.job != "localhost":
    name = f"{spec.job}{spec.task or 0}/{name}"
  return name


def bytes_per_device(variables, strategy):
  """{device: bytes} of `variables` (Keras or TF) as they are held: a
  mirrored variable counts once on each device that has a copy of it,
  a variable placed by hand on its own device."""
  totals = {}
  for variable in variables:
    value = getattr(variable, "value", variable)
    if callable(value):  # A tf.Variable's value() is a method.
      value = variable
    for copy in strategy.experimental_local_results(value):
      name = _short_name(copy.device)
      totals[name] = totals.get(name, 0) + variable_bytes(copy)
  return dict(sorted(totals.items()))


def bytes_by(variables, key):
  """{key(variable): total bytes}, sorted by key."""
  totals = {}
  for variable in variables:
    name = key(variable)
    totals[name] = totals.get(name, 0) + variable_bytes(variable)
  return dict(sorted(totals.items()))
