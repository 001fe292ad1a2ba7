"""tfdist.train, except that worker 1 stops taking part at step 40: its
main thread sleeps (its process and TF runtime stay healthy, so heartbeats
go on), and worker 0 waits in a collective with no end. Used to prove
that SIGTERM still ends a task within --sigterm_grace_seconds."""

import json
import os
import time

from tfdist import runners
from tfdist import train

_run_steps = runners.SyncRunner.run_steps


def _stall_at_step_40(self, iterator, num_steps, steps_per_call, first_step):
  task = json.loads(os.environ["TF_CONFIG"])["task"]
  if (task["type"], task["index"]) == ("worker", 1) and first_step >= 40:
    print("stall_worker: worker 1 stops taking part", flush=True)
    while True:
      time.sleep(3600)
  return _run_steps(self, iterator, num_steps, steps_per_call, first_step)


runners.SyncRunner.run_steps = _stall_at_step_40

if __name__ == "__main__":
  train.run_cli()
