"""tfdist.train, except that worker 1 nudges one weight of its own replica
right after start-up. Used to prove --check_replicas_every catches it."""

import json
import os

import tensorflow as tf

from tfdist import train
from tfdist import trainer

_restore = trainer.Trainer.restore


def _restore_then_perturb(self):
  restored = _restore(self)
  task = json.loads(os.environ["TF_CONFIG"])["task"]
  if (task["type"], task["index"]) == ("worker", 1):
    kernel = self.model.trainable_variables[0].value
    for local_copy in kernel.values:  # Only this worker's copies.
      local_copy.assign_add(tf.fill(local_copy.shape, 0.25))
  return restored


trainer.Trainer.restore = _restore_then_perturb

if __name__ == "__main__":
  train.run_cli()
