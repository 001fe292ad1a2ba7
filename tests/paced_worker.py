"""tfdist.train, except that each train call lasts at least
MIN_CALL_SECONDS (the loop sleeps the rest): with --steps_per_loop=5, at
most about 4 steps/s on any CPU. Used where a test needs membership
changes to happen before the last step, however fast this machine
trains."""

import time

from tfdist import runners
from tfdist import train

MIN_CALL_SECONDS = 1.2

_run_steps = runners.SyncRunner.run_steps


def _paced(self, iterator, num_steps, steps_per_call, first_step):
  started = time.monotonic()
  sums = _run_steps(self, iterator, num_steps, steps_per_call, first_step)
  time.sleep(max(0.0, started + MIN_CALL_SECONDS - time.monotonic()))
  return sums


runners.SyncRunner.run_steps = _paced

if __name__ == "__main__":
  train.run_cli()
