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


def read_json(path):
  """A JSON file, or None where there is none."""
  import json  # pylint: disable=g-import-not-at-top
  if not tf.io.gfile.exists(path):
    return None
  with tf.io.gfile.GFile(path) as f:
    return json.load(f)


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


def copy_file(source, target):
  """Copies a file so that `target` is never half there: into a sibling
  first, then renamed over it."""
  partial = _beside(target, "copying")
  if tf.io.gfile.exists(partial):  # ram:// would not truncate it.
    tf.io.gfile.remove(partial)
  tf.io.gfile.copy(source, partial, overwrite=True)
  tf.io.gfile.rename(partial, target, overwrite=True)


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


def _beside(path, what):
  parent, _, name = path.rstrip("/").rpartition("/")
  return f"{parent}/.{name}-{what}"


def replace_tree(source, target):
  """Moves the complete tree `source` (the staging path of `target`) to
  `target`, replacing what was there, so that a kill at any point loses
  neither: the old tree goes aside whole, the new one moves in, and only
  then is the old one removed. A small state file beside `target`,
  written in one step before each phase and removed last, says how far
  it got; `finish_replace` completes a replace a kill cut short."""
  finish_replace(target)
  _replace_from(source, target, "aside")


def _replace_from(source, target, phase):
  state, previous = _beside(target, "replacing"), _beside(target, "previous")
  if phase == "aside":
    write_text(state, "aside")
    if tf.io.gfile.exists(target):
      _move_files(target, previous)
  write_text(state, "in")
  if tf.io.gfile.exists(source):
    _move_files(source, target)
  remove_tree(previous)
  tf.io.gfile.remove(state)


def finish_replace(target):
  """Completes a `replace_tree(staging_path(target), target)` that a
  kill interrupted, from the phase its state file names; nothing when
  none was."""
  state = _beside(target, "replacing")
  if not tf.io.gfile.exists(state):
    return
  with tf.io.gfile.GFile(state) as f:
    phase = f.read()
  _replace_from(staging_path(target), target, phase)


def staging_path(path):
  """A sibling of `path` to write into first. Not `path` plus a suffix:
  some filesystems (ram://) match a path as a prefix of longer names."""
  parent, _, name = path.rstrip("/").rpartition("/")
  return f"{parent}/.{name}-staging"
