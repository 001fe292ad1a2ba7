"""tfdist: one trainer for every tf.distribute strategy.

    import tfdist
    tfdist.train(MyTask(), model_dir="runs/mine")   # the Python API
    python -m tfdist.train --model_dir=runs/mine    # the CLI
"""

import importlib

from tfdist.config import Config
from tfdist.task import Task

__all__ = ["Config", "FileData", "Task", "train"]


def __getattr__(name):
  # tfdist.train is a module that is also callable; imported on first use
  # so that `python -m tfdist.train` does not find it already imported.
  if name == "train":
    return importlib.import_module("tfdist.train")
  if name == "FileData":  # Imports TensorFlow: only when a user asks.
    return importlib.import_module("tfdist.data").FileData
  raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
