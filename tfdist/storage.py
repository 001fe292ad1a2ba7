"""File operations on model_dir and what lies under it, through tf.io.gfile.

model_dir may be local or on gs://, s3:// or ram://, so nothing here uses
os or shutil.
"""

import os

import tensorflow as tf


def join(*parts):
  """Joins path parts with "/", as every tf.io.gfile filesystem takes."""
  return "/".join([parts[0].rstrip("/"), *(p.strip("/") for p in parts[1:])])


def ensure_writable(path):
  """Creates `path` if needed and proves a file can be written in it;
  raises OSError or tf.errors.OpError if not."""
  probe = join(path, f".tfdist-probe-{os.getpid()}")
  tf.io.gfile.makedirs(path)
  with tf.io.gfile.GFile(probe, "w") as f:
    f.write("")
  tf.io.gfile.remove(probe)


def write_text(path, text):
  """Writes a whole file, in one step for its readers: into a sibling,
  then renamed over `path` (a kill never leaves half a file). The sibling
  is removed first: ram:// does not truncate a file it opens for
  writing."""
  parent, _, name = path.rstrip("/").rpartition("/")
  partial = f"{parent}/.{name}-writing"
  if tf.io.gfile.exists(partial):
    tf.io.gfile.remove(partial)
  with tf.io.gfile.GFile(partial, "w") as f:
    f.write(text)
  tf.io.gfile.rename(partial, path, overwrite=True)


def remove_tree(path):
  """Removes `path` and everything under it, if it exists."""
  if not tf.io.gfile.exists(path):
    return
  try:
    tf.io.gfile.rmtree(path)
    return
  except tf.errors.NotFoundError:
    pass  # ram:// cannot remove a tree at once: file by file.
  for directory, _, files in tf.io.gfile.walk(path, topdown=False):
    for name in files:
      tf.io.gfile.remove(join(directory, name))
    try:
      tf.io.gfile.remove(directory)
    except tf.errors.NotFoundError:
      pass  # A prefix, not an object: gone with its last file.


def _move_files(source, target):
  """Moves every file under `source` to the same place under `target`.
  File by file: renaming a directory moves its files on a local disk and
  on gs://, but not on every filesystem (ram:// moves only the entry)."""
  prefix = source.rstrip("/")
  for directory, _, files in tf.io.gfile.walk(source):
    moved_to = target.rstrip("/") + directory.rstrip("/")[len(prefix):]
    tf.io.gfile.makedirs(moved_to)
    for name in files:
      tf.io.gfile.rename(join(directory, name), join(moved_to, name),
                         overwrite=True)
  remove_tree(source)


def _previous_path(path):
  parent, _, name = path.rstrip("/").rpartition("/")
  return f"{parent}/.{name}-previous"


_MOVED_OUT = ".moved-out"  # In the previous tree: all of it is there.


def replace_tree(source, target):
  """Moves the complete tree `source` (the staging path of `target`) to
  `target`, replacing what was there, so that a kill at any point loses
  neither: the old tree goes aside whole (then marked), the new one moves
  in, and only then is the old one removed. `finish_replace` completes a
  replace a kill cut short."""
  finish_replace(target)
  previous = _previous_path(target)
  if tf.io.gfile.exists(target):
    _move_files(target, previous)
    write_text(join(previous, _MOVED_OUT), "")
  _move_files(source, target)
  remove_tree(previous)


def finish_replace(target):
  """Completes a `replace_tree(staging_path(target), target)` that a
  kill interrupted, from the step it reached; nothing when none was."""
  previous = _previous_path(target)
  if not tf.io.gfile.exists(previous):
    return
  if not tf.io.gfile.exists(join(previous, _MOVED_OUT)):
    if tf.io.gfile.exists(target):  # Cut short while moving the old aside.
      _move_files(target, previous)
    write_text(join(previous, _MOVED_OUT), "")
  staging = staging_path(target)
  if tf.io.gfile.exists(staging):  # Cut short while moving the new in.
    _move_files(staging, target)
  remove_tree(previous)


def staging_path(path):
  """A sibling of `path` to write into first. Not `path` plus a suffix:
  some filesystems (ram://) match a path as a prefix of longer names."""
  parent, _, name = path.rstrip("/").rpartition("/")
  return f"{parent}/.{name}-staging"
