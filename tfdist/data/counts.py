"""How many records each TFRecord file holds: given by the user, kept
from an earlier run of the same model_dir, or counted from the record
headers.

Counting reads every header: 12 bytes a record locally, but every byte
through a 512 KiB buffer on object stores, and a whole decompression for
GZIP. So a run keeps what it counted, with each file's size and
modification time, in its run record (tfdist_run.json), and a resume
counts only the files that changed since.
"""

import collections.abc
import concurrent.futures
import dataclasses
import numbers
import os
import struct

import tensorflow as tf

from tfdist.errors import ConfigError

_HEADER = 12  # uint64 length, uint32 masked CRC of the length.
_FOOTER = 4  # uint32 masked CRC of the data.
_THREADS = 8  # Files stat'ed and counted at once (object-store latency).


@dataclasses.dataclass(frozen=True)
class Found:
  """One file: its bytes, modification time, records, and whether this
  process counted them (or knew them)."""

  length: int
  mtime: int
  records: int
  counted: bool
  given: bool = False  # By the user: kept marked as given.


def check_given(record_counts):
  """FileData's record_counts: {path: records >= 0}, or None."""
  if record_counts is None:
    return
  if not (isinstance(record_counts, collections.abc.Mapping) and all(
      isinstance(p, str) and isinstance(n, numbers.Integral)
      and not isinstance(n, bool) and n >= 0
      for p, n in record_counts.items())):
    raise ConfigError("FileData record_counts takes {path: records}, "
                      "records a non-negative int. Received: "
                      f"record_counts={str(record_counts)[:120]}")


def given(record_counts):
  """A user's counts as `known` entries: true whatever the file's time."""
  return {path: [None, None, int(n)]
          for path, n in (record_counts or {}).items()}


def to_keep(found):
  """What the run keeps: {path: [bytes, mtime, records]}; a count the user
  gave is marked so ([..., "given"]): the workers compare it, and a later
  run does not take it for one it counted."""
  return {path: [f.length, f.mtime, f.records, *(["given"] if f.given
                                                 else [])]
          for path, f in found.items()}


def _scan(stream, size):
  """Records in a TFRecord stream of `size` bytes, reading 12 bytes of
  each. A length that runs past the end is not a TFRecord file (the
  headers' CRCs are not checked: that would read them in Python)."""
  records = position = 0
  while position < size:
    header = stream.read(_HEADER)
    (length,) = struct.unpack("<Q", header.ljust(_HEADER, b"\0")[:8])
    position += _HEADER + length + _FOOTER
    if len(header) < _HEADER or position > size:
      raise ValueError(f"record {records} runs past the end of the file")
    stream.seek(length + _FOOTER, 1)
    records += 1
  return records


def count_records(path, compression):
  """A TFRecord file's records. Local files: from the headers alone
  (unbuffered, so 12 bytes per record are read). Other filesystems read
  through a buffer; compressed files are decompressed once."""
  if compression:
    return int(tf.data.TFRecordDataset(path, compression_type=compression)
               .reduce(0, lambda total, _: total + 1))
  if "://" not in path:
    with open(path, "rb", buffering=0) as stream:
      return _scan(stream, os.fstat(stream.fileno()).st_size)
  with tf.io.gfile.GFile(path, "rb") as stream:
    return _scan(stream, stream.size())


def _one(path, compression, name, known):
  """A file's Found: its stat, and its records, known or counted."""
  try:
    stat = tf.io.gfile.stat(path)
    entry = known.get(path)
    if entry and entry[0] is None:  # Given by the user.
      return Found(stat.length, stat.mtime_nsec, int(entry[2]), False, True)
    # Kept by a run, and counted by it: while the file's size and time
    # are the same (a filesystem that gives no time, 0, is counted again).
    if entry and len(entry) == 3 and stat.mtime_nsec and entry[:2] == [
        stat.length, stat.mtime_nsec]:
      return Found(stat.length, stat.mtime_nsec, int(entry[2]), False)
    return Found(stat.length, stat.mtime_nsec,
                 count_records(path, compression), True)
  except (OSError, ValueError, tf.errors.OpError) as e:
    raise ConfigError(f"{name}: cannot read {path} as TFRecords "
                      f"({type(e).__name__}: {str(e)[:160]})") from None


def record_counts(paths, compression, name, *, known):
  """{path: Found} for `paths`; `known`: {path: [bytes or None, mtime or
  None, records]} (a run record's, or a user's), used where the file's
  bytes and time still match."""
  pool = concurrent.futures.ThreadPoolExecutor(_THREADS)
  try:
    return dict(zip(paths, pool.map(
        lambda path: _one(path, compression, name, known), paths)))
  finally:
    pool.shutdown(wait=False, cancel_futures=True)
