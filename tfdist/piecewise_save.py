"""A checkpoint whose sharded entries are written a piece at a time.

TF's saver takes every tensor of a checkpoint before it writes one, so a
sharded run that gives it its whole state would hold that state whole.
Instead, while saving, each sharded entry gives TF a value-less SaveSpec:
TF records the entry in the checkpoint's object graph (and names the
spec with its checkpoint key) but writes no value for it. Once TF has
written the checkpoint (a write callback of `tf.train.CheckpointOptions`,
which runs before CheckpointManager records the checkpoint as the
latest), `write` gathers and writes the entries a piece (a unit) at a
time, each into its own file, and merges those into the checkpoint.
The result is the unsharded run's checkpoint, key for key.

The SaveSpec is private to TF; tests/test_private_apis.py pins the
behaviour this module needs.
"""

import re

from absl import logging
import tensorflow as tf
from tensorflow.python.training.saving import saveable_object  # pylint: disable=g-direct-tensorflow-import

class PiecewiseSave:
  """One save: the value-less specs TF was given, by the owner's key."""

  def __init__(self, *, device):
    # A spec grouped under its own device (not "/cpu:0") joins the task's
    # other tensors: a group of value-less specs alone fails to save.
    self._device = device
    self._specs = {}

  def entry(self, key, dtype):
    """What an entry's `_serialize_to_tensors` gives TF during the save."""
    spec = saveable_object.SaveSpec(lambda: None, "", "", dtype=dtype,
                                    device=self._device)
    self._specs[key] = spec
    return spec

  def write(self, path, pieces):
    """After TF wrote checkpoint `path`: writes each of `pieces` ({key:
    tensor}, made one at a time), then merges them into `path`. First
    removes what a save killed while writing left in its directory."""
    _sweep(path)
    parts, written = [], set()
    try:
      for n, piece in enumerate(pieces):
        keys = [k for k in piece if k in self._specs]
        parts.append(f"{path}_piece{n}")
        tf.raw_ops.SaveV2(
            prefix=parts[-1],
            tensor_names=[self._specs[k].name for k in keys],
            shape_and_slices=[""] * len(keys),
            tensors=[piece[k] for k in keys])
        written.update(keys)
        del piece
      missing = set(self._specs) - written
      if missing:
        raise RuntimeError(f"piecewise save: no piece holds {sorted(missing)}")
      merged = f"{path}_merged"
      tf.raw_ops.MergeV2Checkpoints(
          checkpoint_prefixes=[path] + parts, destination_prefix=merged,
          delete_old_dirs=False)  # Deletes the files it merged.
      for name in _files(merged):
        tf.io.gfile.rename(name, path + name[len(merged):], overwrite=True)
      if not tf.io.gfile.exists(f"{path}.index"):
        raise RuntimeError(f"piecewise save: {path}.index was not written")
    except BaseException:
      for name in _files(f"{path}_piece") + _files(f"{path}_merged"):
        tf.io.gfile.remove(name)
      raise


def _sweep(path):
  """Removes the pieces and merged files of earlier saves to `path`'s
  directory under its name (`<name>-<step>_piece<n>.*`, `_merged.*`):
  only a save killed before it cleaned up leaves them."""
  directory, _, name = path.rpartition("/")
  stale = re.compile(re.escape(name.rpartition("-")[0])
                     + r"-\d+_(piece\d+|merged)\.")
  for found in tf.io.gfile.listdir(directory):
    if stale.match(found):
      try:
        tf.io.gfile.remove(f"{directory}/{found}")
      except tf.errors.OpError as e:  # Not worth failing the save for.
        logging.warning("Could not remove %s/%s, left by an earlier "
                        "save: %s", directory, found, e.message)


def _files(prefix):
  """The files whose path starts with `prefix` (listed, not globbed: a
  model_dir may hold glob characters)."""
  directory, _, start = prefix.rpartition("/")
  return [f"{directory}/{name}" for name in tf.io.gfile.listdir(directory)
          if name.startswith(start)]
