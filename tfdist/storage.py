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
  """Writes a whole file. The old one is removed first: ram:// does not
  truncate a file it opens for writing."""
  if tf.io.gfile.exists(path):
    tf.io.gfile.remove(path)
  with tf.io.gfile.GFile(path, "w") as f:
    f.write(text)


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


def replace_tree(source, target):
  """Moves the tree `source` to `target`, replacing what was there.

  File by file: renaming a directory moves its files on a local disk and
  on gs://, but not on every filesystem (ram:// moves only the entry).
  """
  remove_tree(target)
  tf.io.gfile.makedirs(target)
  prefix = source.rstrip("/")
  for directory, _, files in tf.io.gfile.walk(source):
    moved_to = target.rstrip("/") + directory.rstrip("/")[len(prefix):]
    tf.io.gfile.makedirs(moved_to)
    for name in files:
      tf.io.gfile.rename(join(directory, name), join(moved_to, name))
  remove_tree(source)


def staging_path(path):
  """A sibling of `path` to write into first. Not `path` plus a suffix:
  some filesystems (ram://) match a path as a prefix of longer names."""
  parent, _, name = path.rstrip("/").rpartition("/")
  return f"{parent}/.{name}-staging"
