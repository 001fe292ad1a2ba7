"""Names a stalled peer before TensorFlow's own collective timeout fires.

TF's abort of a timed-out ring races the RPCs still in flight, and now and
then crashes the process (TF 2.21: SIGABRT in
CancellationManager::DeregisterCallback from GrpcRemoteWorker::RecvBufAsync
after "StartAbort DEADLINE_EXCEEDED"): the task then dies by a signal
instead of naming its peer and exiting with the lost-peer code. So a loop
call that runs past its deadline, its usual length plus the larger of
`timeout_seconds` and that length (a call may take twice its usual time
before it counts as stalled), ends the task here, from a timer thread,
with that line and code. TF's own timeout (`tf_backstop_seconds`) is the
backstop: for the first call of a loop, whose usual length is not known
yet, for collectives outside loop calls, and for calls longer than
`timeout_seconds`, where it may act first (TF's abort, as before): the
watch says so in one warning, once it knows a call's usual length.
"""

import contextlib
import os
import sys
import threading
import time

from absl import logging

from tfdist import errors
from tfdist.errors import PEER_LOST_EXIT_CODE


def tf_backstop_seconds(timeout_seconds):
  """TF's collective timeout for a --collective_timeout: later than the
  watch's deadline for a stall in a call shorter than the timeout. In a
  longer call (whose deadline is twice its usual length) TF's may act
  first."""
  return 2 * timeout_seconds if timeout_seconds else None


class StallWatch:
  """Per loop call: a deadline of its usual length plus the larger of
  the timeout and that length."""

  def __init__(self, *, timeout_seconds, message, err=None,
               exit_fn=os._exit, clock=time.monotonic):
    if timeout_seconds <= 0:
      raise ValueError(f"timeout_seconds must be > 0. Received: "
                       f"timeout_seconds={timeout_seconds!r}")
    self._timeout = timeout_seconds
    self._message = message
    self._err = err or sys.stderr
    self._exit = exit_fn
    self._clock = clock
    # key -> [first call's length, longest later call's length or None].
    self._lengths = {}
    self._warned = set()  # Kinds (train, eval) whose calls outlast it.

  def usual_seconds(self, key):
    """The longest call of `key` after its first (which traces), or the
    first when there is no other; None before any."""
    lengths = self._lengths.get(key)
    if lengths is None:
      return None
    return lengths[0] if lengths[1] is None else lengths[1]

  def deadline_seconds(self, key):
    usual = self.usual_seconds(key)
    return None if usual is None else usual + max(self._timeout, usual)

  @contextlib.contextmanager
  def watching(self, key):
    deadline = self.deadline_seconds(key)
    call = {"done": False, "lock": threading.Lock()}
    timer = None
    if deadline is not None:
      timer = threading.Timer(deadline, self._fire, args=(call,))
      timer.daemon = True
      timer.start()
    started = self._clock()
    try:
      yield
    finally:
      with call["lock"]:  # A call that ends at its deadline ends well.
        call["done"] = True
      if timer:
        timer.cancel()
    self._record(key, self._clock() - started)

  def _record(self, key, seconds):
    if key not in self._lengths:
      self._lengths[key] = [seconds, None]
    else:
      later = self._lengths[key][1]
      self._lengths[key][1] = seconds if later is None else max(later,
                                                                seconds)
      self._warn_if_longer(key)

  def _warn_if_longer(self, key):
    """Once per kind of call (train, eval): its calls outlast the
    timeout, so TF's own timeout may end a stall in one first, with the
    abort that can crash the task instead of naming the peer."""
    usual = self.usual_seconds(key)
    kind = key[0] if isinstance(key, tuple) else key  # train or eval.
    if usual <= self._timeout or kind in self._warned:
      return
    self._warned.add(kind)
    logging.warning(
        "%s calls take %.1fs, longer than --collective_timeout=%g: a peer "
        "that stalls in one may be caught first by TF's own collective "
        "timeout (%gs), whose abort can end this task by a signal instead "
        "of naming the peer. Set --collective_timeout above %.0fs%s.",
        kind, usual, self._timeout, tf_backstop_seconds(self._timeout),
        usual, " (or lower --steps_per_loop)" if kind == "train" else "")

  def _fire(self, call):
    # No unwinding: the main thread is blocked inside TF, and a clean exit
    # would wait on it (or on TF's crashy abort).
    with call["lock"]:
      if call["done"]:
        return
      errors.exit_at_once(self._message, PEER_LOST_EXIT_CODE, err=self._err,
                          exit_fn=self._exit)
