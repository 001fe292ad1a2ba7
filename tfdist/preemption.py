"""SIGTERM (or SIGHUP) → checkpoint → exit 42, agreed across all workers,
bounded in time.

tfdist does its own agreement, on every platform. (TF's
PreemptionCheckpointHandler stops acting on SIGTERM on GCE and GKE CPU
machines, which it detects through the metadata server, and waits without
bound for peers that never answer.) SIGTERM sets a flag; the next loop
call carries it in the vector it already all-reduces, so every worker
learns of it at the same step, saves there and exits with
PREEMPTED_EXIT_CODE. A watchdog makes the task exit by itself when no
agreement comes within the grace period (a peer gone or stalled).
"""

import contextlib
import os
import signal
import threading

from absl import logging

from tfdist import errors
from tfdist.errors import PREEMPTED_EXIT_CODE
from tfdist.errors import TfdistError

# The exit code of a task that got SIGTERM and could not save in time.
UNSAVED_EXIT_CODE = 128 + signal.SIGTERM


class PreemptedError(TfdistError):
  """Raised after the preemption checkpoint is written."""

  exit_code = PREEMPTED_EXIT_CODE


# SIGHUP too: a task started over `ssh -tt` gets SIGHUP, not SIGTERM,
# when its launcher stops it.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class SigtermFlag:
  """Catches SIGTERM (and SIGHUP); `requested` is read by each loop call.
  After `grace_seconds` without an exit, a watchdog ends the process with
  UNSAVED_EXIT_CODE, unless a checkpoint is being written (it waits for
  that to finish). A finished save, `disarm()` and `close()` disarm it.

  A Python signal handler runs only when the main thread returns to the
  interpreter, which a task stuck in a collective never does. So a thread
  also listens on the signal wakeup fd, which CPython writes the moment a
  signal arrives, and starts the watchdog from there.

  The listener also notes Ctrl-C: TF now and then swallows the
  KeyboardInterrupt (raised inside a `__del__`, where Python ignores it),
  and the run would go on. `raise_if_interrupted` raises it again at the
  next loop call, unless someone else handles SIGINT.

  Signal handlers can only be set from the main thread: elsewhere (a Ray
  Tune function trainable, a notebook's worker thread) the flag logs one
  line and never rises.
  """

  def __init__(self, *, grace_seconds, task_name="this task",
               on_repeat=None, exit_fn=os._exit):  # pylint: disable=protected-access
    self._grace_seconds = grace_seconds
    self._exit_fn = exit_fn
    self._task_name = task_name
    self._on_repeat = on_repeat  # Called on the second SIGTERM.
    self._saving = threading.RLock()  # save_and_stop's save saves.
    self._noted = threading.Lock()
    self._disarmed = threading.Event()
    self._handled = 0
    self.requested = False
    self._interrupted = False
    self._previous_handlers = None
    if threading.current_thread() is not threading.main_thread():
      logging.warning(
          "tfdist runs outside the main thread, where Python cannot catch "
          "signals: a SIGTERM will not save a checkpoint. Call it from the "
          "main thread for preemption saves.")
      return
    # A SIGHUP the host ignores (nohup) stays ignored.
    self._previous_handlers = {
        signum: signal.signal(signum, self._on_sigterm)
        for signum in STOP_SIGNALS
        if signal.getsignal(signum) is not signal.SIG_IGN}
    self._read_end, self._write_end = os.pipe()
    os.set_blocking(self._write_end, False)
    self._previous_fd = signal.set_wakeup_fd(self._write_end,
                                             warn_on_full_buffer=False)
    threading.Thread(target=self._listen, daemon=True,
                     name="tfdist-sigterm-listener").start()

  def disarm(self):
    """From now on a SIGTERM ends nothing: what it would save is saved."""
    self._disarmed.set()

  def close(self):
    """Disarms, and gives the caller back its handlers and wakeup fd (the
    Python API trains inside someone else's process)."""
    self.disarm()
    if self._previous_handlers is None:
      return
    signal.set_wakeup_fd(self._previous_fd)
    for signum, handler in self._previous_handlers.items():
      signal.signal(signum, handler)
    os.close(self._write_end)  # The listener reads EOF and ends.

  def _listen(self):
    while True:
      data = os.read(self._read_end, 64)
      if not data:
        os.close(self._read_end)
        return
      if any(signum in data for signum in STOP_SIGNALS):
        self._note()
      if (signal.SIGINT in data and
          signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        self._interrupted = True

  def raise_if_interrupted(self):
    """Raises the KeyboardInterrupt of a Ctrl-C that got lost on the way."""
    if self._interrupted:
      raise KeyboardInterrupt

  def _note(self):
    """The first SIGTERM: set the flag, start the watchdog (once)."""
    if self._noted.acquire(blocking=False):
      self.requested = True
      threading.Thread(target=self._watchdog, daemon=True,
                       name="tfdist-sigterm-watchdog").start()

  def _on_sigterm(self, signum, frame):
    del signum, frame
    self._note()
    self._handled += 1
    if self._handled > 1 and self._on_repeat:
      self._on_repeat()

  def _watchdog(self):
    if self._disarmed.wait(self._grace_seconds):
      return
    with self._saving:  # A checkpoint being written is worth waiting for.
      if self._disarmed.is_set():
        return
      errors.exit_at_once(
          f"{self._task_name} got SIGTERM and could not stop at an agreed "
          f"step within {self._grace_seconds:g}s (a peer is gone or "
          f"stalled); exiting with code {UNSAVED_EXIT_CODE}, without a new "
          "checkpoint.", UNSAVED_EXIT_CODE, exit_fn=self._exit_fn)

  def save_and_stop(self, save_fn, step_fn):
    """Saves (the watchdog waits meanwhile) and raises PreemptedError."""
    with self._saving:
      save_fn()
      self.disarm()  # Saved: the exit is PREEMPTED_EXIT_CODE, however late.
    raise PreemptedError(
        f"preempted (SIGTERM): checkpoint saved at step {step_fn()}; "
        f"exiting with code {PREEMPTED_EXIT_CODE} so the launcher resumes.")


class Unwatched:
  """What a run that does not save on SIGTERM watches with: nothing."""

  def disarm(self):
    pass


class SigtermGuard:
  """For parameter-server coordinators: SIGTERM sets a flag that is checked
  when all scheduled steps have joined; then the chief saves and exits.

  If no worker is left to finish the scheduled steps, the join never
  returns; a second SIGTERM (the launcher sends one when every worker is
  gone) that comes while the chief waits in the join saves at once, with
  the steps counted so far, and stops. Anywhere else (a checkpoint being
  written, say) the second SIGTERM changes nothing: the main thread gets
  to the next check by itself.
  """

  def __init__(self, *, save_fn, step_fn, grace_seconds):
    self._save_fn = save_fn
    self._step_fn = step_fn
    self._joining = False
    self._flag = SigtermFlag(grace_seconds=grace_seconds,
                             task_name="the chief",
                             on_repeat=self._on_repeat)

  def _on_repeat(self):
    if self._joining:
      self._joining = False
      self._flag.save_and_stop(self._save_fn, self._step_fn)

  @contextlib.contextmanager
  def joining(self):
    """Marks the wait for scheduled steps, the one wait that may never
    end."""
    self._joining = True
    try:
      yield
    finally:
      self._joining = False

  def disarm(self):
    self._flag.disarm()

  def save_and_exit_if_signalled(self):
    self._flag.raise_if_interrupted()
    if self._flag.requested:
      self._flag.save_and_stop(self._save_fn, self._step_fn)

  def close(self):
    self._flag.close()
