"""A user's model whose worker 1 dies while the model is built: worker 0
is then in the collectives that give the variables their first values
(MultiWorkerMirrored takes them from worker 0)."""

import json
import os

import keras


def build():
  task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
  if task.get("type") == "worker" and task.get("index") == 1:
    os._exit(3)  # pylint: disable=protected-access
  return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(10)])
