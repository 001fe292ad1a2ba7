"""Keeps TensorFlow's native start-up noise off the console.

TF 2.21 logs oneDNN and cpu_feature_guard lines through absl's C++ logger,
which ignores TF_CPP_MIN_LOG_LEVEL, so the only way to hide them is to point
file descriptor 2 elsewhere while TensorFlow starts.
"""

import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def native_stderr_captured(enabled=True):
  """Captures fd 2 inside the block; replays it if the block crashes."""
  if not enabled:
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as sink:
    os.dup2(sink.fileno(), 2)
    crashed = False
    try:
      yield
    except Exception as e:
      # A user error is reported on its own; a crash needs the context.
      crashed = not getattr(e, "exit_code", None)
      raise
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      if crashed:
        sink.seek(0)
        os.write(2, sink.read())
