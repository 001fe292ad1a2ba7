"""Errors that the CLI reports as one line, without a traceback."""

import os
import re
import shutil
import sys

from absl import logging

# A task that saved a checkpoint on SIGTERM exits with this; launchers
# resume the job.
PREEMPTED_EXIT_CODE = 42
# A task whose gRPC port was taken between the launcher's probe and its
# bind exits with this; launchers relaunch with new ports.
PORT_TAKEN_EXIT_CODE = 43
# A task that lost a peer (a collective timed out or was aborted) exits
# with this: the loss of another task, never an error of its own.
PEER_LOST_EXIT_CODE = 5


def first_line(error, limit=160, *, empty=None):
  """The first line of `error`'s message, for a one-line error or
  warning: without TF's {{function_node ...}} tags and its link, cut to
  `limit` characters. An empty message gives `empty`, or the error's
  type name."""
  text = str(getattr(error, "message", None) or error).strip()
  if not text:
    return type(error).__name__ if empty is None else empty
  line = re.sub(r"\{\{[^}]*\}\}\s*", "", text.splitlines()[0])
  return line.split(": goo.gle")[0].strip()[:limit]


class TfdistError(Exception):
  """A problem the user can fix: bad input, bad model_dir, bad cluster."""

  exit_code = 2


class ConfigError(TfdistError, ValueError):
  """An invalid flag value or combination of values."""


class CheckpointError(TfdistError):
  """A model_dir whose checkpoints cannot be used for this run."""


class NonFiniteLossError(TfdistError):
  """Training produced a NaN or Inf loss."""

  exit_code = 3


class PortTakenError(TfdistError):
  """This task's gRPC server could not bind its TF_CONFIG address."""

  exit_code = PORT_TAKEN_EXIT_CODE


def exit_at_once(message, exit_code, *, err=None, exit_fn=os._exit):  # pylint: disable=protected-access
  """Writes the one-line error, flushes the streams and ends the process
  without unwinding: a task whose main thread is blocked inside TF (a
  stalled collective, a SIGTERM with no step agreed) would wait on it,
  and one that lost a peer or was preempted (its state written) would
  wait 1-3 s on TF's teardown of a cluster going away."""
  try:
    err = err or sys.stderr
    err.write(f"tfdist: error: {message}\n")
    err.flush()
    sys.stdout.flush()
    logging.flush()
  except Exception:  # pylint: disable=broad-except
    pass  # A closed pipe or a hung-up tty must not keep the process alive.
  finally:
    exit_fn(exit_code)


def exit_removing(path, exit_fn=os._exit):  # pylint: disable=protected-access
  """An exit function for exit_at_once that first removes `path`: a
  non-chief's scratch model_dir, which no launcher may own (SSH) and
  which os._exit would leave behind."""
  def exit_now(code):
    shutil.rmtree(path, ignore_errors=True)
    exit_fn(code)
  return exit_now
