"""How many malloc arenas a run's process keeps (glibc).

glibc gives each thread that allocates under contention an arena of its
own, up to 8 per core, and memory freed in one arena is not reused for
another's allocations. TensorFlow's executor frees a tensor on one
thread and allocates the next on another, so a run's peak RSS grows with
the arenas: 20% of a --shard=params run's peak on the 100M-parameter
benchmark (docs/trainer.md). Set before TensorFlow starts its threads.
"""

import ctypes

_M_ARENA_MAX = -8  # glibc's malloc.h


def count(config):
  """--malloc_arenas, or its default: 2 with --shard=params (measured:
  docs/trainer.md), else glibc's own (0)."""
  if config.malloc_arenas:
    return config.malloc_arenas
  return 2 if config.shard == "params" else 0


def limit(count):
  """Caps the process's malloc arenas at `count` (0: glibc's default).
  Returns whether the cap is set (False where the C library has no
  mallopt, as on macOS or musl)."""
  if not count:
    return False
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return False
  return mallopt(_M_ARENA_MAX, count) == 1
