"""Ctrl-C that TensorFlow swallows: a KeyboardInterrupt raised inside a
`__del__` (TF's AtomicFunction.__del__, seen on 2 MWMS workers) is only
printed by Python, and the run would go on. The SIGTERM listener notes the
SIGINT, and the runner raises it again at its next loop call."""

import os
import signal
import sys
import time

import pytest

from tfdist import preemption


class _LosesCtrlC:
  """Gets the SIGINT inside `__del__`, where Python ignores the
  KeyboardInterrupt its handler raises."""

  def __del__(self):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # The handler runs here, inside __del__.


def _interrupted_within(flag, seconds):
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    try:
      flag.raise_if_interrupted()
    except KeyboardInterrupt:
      return True
    time.sleep(0.05)
  return False


@pytest.fixture
def flag():
  flag = preemption.SigtermFlag(grace_seconds=60)
  yield flag
  flag.close()


def test_a_ctrl_c_lost_in_a_del_is_raised_again(flag, monkeypatch):
  ignored = []  # What Python would only print.
  monkeypatch.setattr(sys, "unraisablehook",
                      lambda info: ignored.append(info.exc_type))
  assert not _interrupted_within(flag, 0.2)
  _LosesCtrlC()  # Dropped at once: __del__ runs here.
  assert ignored == [KeyboardInterrupt]
  assert _interrupted_within(flag, 5)
  assert not flag.requested  # Ctrl-C is not a preemption: no save.


def test_a_ctrl_c_someone_else_handles_is_left_to_them(flag):
  seen = []
  previous = signal.signal(signal.SIGINT, lambda *_: seen.append(1))
  try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    assert seen == [1]
    assert not _interrupted_within(flag, 1)
  finally:
    signal.signal(signal.SIGINT, previous)
