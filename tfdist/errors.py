"""Errors that the CLI reports as one line, without a traceback."""

# A task that saved a checkpoint on SIGTERM exits with this; launchers
# resume the job.
PREEMPTED_EXIT_CODE = 42
# A task whose gRPC port was taken between the launcher's probe and its
# bind exits with this; launchers relaunch with new ports.
PORT_TAKEN_EXIT_CODE = 43
# A task that lost a peer (a collective timed out or was aborted) exits
# with this: the loss of another task, never an error of its own.
PEER_LOST_EXIT_CODE = 5


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
