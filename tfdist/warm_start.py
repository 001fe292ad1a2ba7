"""Warm start: a new run's model weights from a checkpoint of another run
(--init_checkpoint), at step 0, before training. Only the model's
weights: not the optimizer, not the step.

A tfdist checkpoint (a ckpt-N prefix, or a directory whose latest
checkpoint is taken), a Keras `.weights.h5` or a `.keras` file.
`--init_checkpoint_skip=REGEX` leaves the variables whose path matches
(a new head, say) as initialised. From a tfdist checkpoint they are never
read, so they may have another shape in the source (another class count)
or be missing from it; a Keras file loads whole, so they must fit.
"""

import re

from absl import logging
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from tfdist import errors
from tfdist.errors import CheckpointError

_KERAS_SUFFIXES = (".weights.h5", ".keras")
_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"


def _tfdist_checkpoint(path):
  """The checkpoint prefix `path` names (itself, or a directory's latest)."""
  if tf.io.gfile.exists(f"{path}.index"):
    return path
  if tf.io.gfile.isdir(path):
    latest = tf.train.latest_checkpoint(path)
    if latest:
      return latest
  raise CheckpointError(f"--init_checkpoint={path}: no checkpoint there (a "
                        "ckpt-N prefix, a directory with checkpoints, a "
                        ".weights.h5 or a .keras file); nothing was changed.")


def checkpoint_keys(model, reader):
  """{id(variable): key in the checkpoint} for the variables of `model`
  that the checkpoint holds under its `model` child, found as TF's
  restore finds them: by walking the checkpoint's object graph beside the
  model's own (each variable is saved once, under its shortest path,
  which for trainable weights runs through the optimizer)."""
  graph = trackable_object_graph_pb2.TrackableObjectGraph()
  graph.ParseFromString(reader.get_tensor(_OBJECT_GRAPH))
  roots = [c.node_id for c in graph.nodes[0].children
           if c.local_name == "model"]
  keys, seen = {}, set()

  def walk(obj, node_id):
    if id(obj) in seen:
      return
    seen.add(id(obj))
    node = graph.nodes[node_id]
    for attribute in node.attributes:
      if attribute.name == "VARIABLE_VALUE":
        keys[id(obj)] = attribute.checkpoint_key
    saved = {c.local_name: c.node_id for c in node.children}
    for name, child in tf.train.TrackableView(obj).children(obj).items():
      if name in saved:
        walk(child, saved[name])

  if roots:
    walk(model, roots[0])
  return keys


def _values_to_load(model, source, skipped):
  """[(variable, value)] for every model variable not skipped, or
  CheckpointError naming those the source lacks or holds in another
  shape (nothing is assigned then)."""
  # A prefix, read as one: load_checkpoint would take a ram:// prefix for
  # a directory (ram:// matches a path as the prefix of longer names).
  reader = tf.compat.v1.train.NewCheckpointReader(source)
  keys = checkpoint_keys(model, reader)
  skipped_ids = {id(v) for v in skipped}
  loads, missing, reshaped = [], [], []
  for variable in model.weights:
    if id(variable) in skipped_ids:
      continue
    key = keys.get(id(variable))
    if key is None:
      missing.append(variable.path)
      continue
    value = reader.get_tensor(key)
    if tuple(value.shape) != tuple(variable.shape):
      reshaped.append(f"{variable.path} {tuple(value.shape)} -> "
                      f"{tuple(variable.shape)}")
    else:
      loads.append((variable, value))
  if missing or reshaped:
    shown = [f"missing: {', '.join(missing[:3])}"] if missing else []
    shown += [f"another shape: {', '.join(reshaped[:3])}"] if reshaped else []
    raise CheckpointError(
        f"--init_checkpoint={source} does not fit this model "
        f"({'; '.join(shown)}); leave such variables out with "
        "--init_checkpoint_skip=REGEX. Nothing was changed.")
  return loads


def load(model, path, *, skip=""):
  """Loads `path`'s weights into `model`, but the variables whose path
  matches `skip`; returns (the file read, the skipped variable paths)."""
  pattern = re.compile(skip) if skip else None
  skipped = [v for v in model.weights
             if pattern is not None and pattern.search(v.path)]
  initial = [(v, v.numpy()) for v in skipped]
  try:
    if path.endswith(_KERAS_SUFFIXES):
      # Keras files load whole: a skipped variable must still fit (its
      # value is put back after). skip_mismatch would also skip layers
      # not named, silently.
      model.load_weights(path)
      source = path
    else:
      source = _tfdist_checkpoint(path)
      for variable, value in _values_to_load(model, source, skipped):
        variable.assign(value)
  except CheckpointError:
    raise
  except (tf.errors.OpError, ValueError, OSError, AssertionError) as e:
    raise CheckpointError(
        f"--init_checkpoint={path} does not fit this model "
        f"({errors.first_line(e)}); nothing was changed.") from None
  for variable, value in initial:
    variable.assign(value)
  logging.info("Warm start: model weights from %s%s.", source,
               f", but {len(skipped)} variable(s) matching "
               f"{skip!r} ({', '.join(v.path for v in skipped[:3])}"
               f"{'...' if len(skipped) > 3 else ''})" if skipped else "")
  return source, [v.path for v in skipped]
