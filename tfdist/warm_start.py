"""Warm start: a new run's model weights from a checkpoint of another run
(--init_checkpoint), at step 0, before training. Only the model's
weights: not the optimizer, not the step.

A tfdist checkpoint (a ckpt-N prefix, or a directory whose latest
checkpoint is taken), a Keras `.weights.h5` or a `.keras` file.
`--init_checkpoint_skip=REGEX` leaves the variables whose path matches
(a new head, say) as initialised.
"""

import re

from absl import logging
import tensorflow as tf

from tfdist.errors import CheckpointError

_KERAS_SUFFIXES = (".weights.h5", ".keras")


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


def load(model, path, *, skip=""):
  """Loads `path`'s weights into `model`, but the variables whose path
  matches `skip`; returns (the file read, the skipped variable paths)."""
  pattern = re.compile(skip) if skip else None
  skipped = [v for v in model.weights
             if pattern is not None and pattern.search(v.path)]
  initial = [(v, v.numpy()) for v in skipped]
  try:
    if path.endswith(_KERAS_SUFFIXES):
      model.load_weights(path)
      source = path
    else:
      source = _tfdist_checkpoint(path)
      status = tf.train.Checkpoint(model=model).restore(source)
      status.expect_partial()
      status.assert_existing_objects_matched()
  except CheckpointError:
    raise
  except (tf.errors.OpError, ValueError, OSError, AssertionError) as e:
    raise CheckpointError(
        f"--init_checkpoint={path} does not fit this model "
        f"({str(e).splitlines()[0][:160]}); nothing was changed.") from None
  for variable, value in initial:
    variable.assign(value)
  logging.info("Warm start: model weights from %s%s.", source,
               f", but {len(skipped)} variable(s) matching "
               f"{skip!r} ({', '.join(v.path for v in skipped[:3])}"
               f"{'...' if len(skipped) > 3 else ''})" if skipped else "")
  return source, [v.path for v in skipped]
