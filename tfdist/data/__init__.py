"""tfdist's input, split as Model Garden's InputReader is:

  sources   Dataset (examples per split) and a user's own tf.data datasets
  files     FileData, the file-backed contract: patterns, counts, parse
  catalog   the built-in datasets: digits, synthetic, tfds names
  order     the planned order of a split streamed from files, and resume
  sharding  which host reads what: --input_sharding
  cache     what is cached: --cache
  counts    each file's records: given, kept from a run, or counted
  randomness  every random draw: shuffles, augmentation
  pipeline  the train input function
  inputs    Inputs, what the Trainer is handed: from a Dataset, the
            service or a task's own input functions
  eval_input  the eval input function, padded and masked
  plan      what a run keeps of its input plan, and its changes
  agreement every worker sees the same files
  service   train input on the tf.data service (service_units: its units)
"""

from tfdist.data.catalog import load
from tfdist.data.files import FileData
from tfdist.data.files import to_dataset as file_dataset
from tfdist.data.inputs import Inputs
from tfdist.data.pipeline import SHUFFLE_BUFFER
from tfdist.data.eval_input import SYNTHETIC_EVAL_STEPS
from tfdist.data.eval_input import eval_input_fn
from tfdist.data.eval_input import eval_steps
from tfdist.data.inputs import inputs_from_dataset
from tfdist.data.inputs import inputs_from_task
from tfdist.data.inputs import served_inputs
from tfdist.data.pipeline import train_input_fn
from tfdist.data.plan import describe_plan_change
from tfdist.data.sharding import resolve_sharding
from tfdist.data.sources import Dataset
from tfdist.data.sources import features_spec
from tfdist.data.sources import from_user
from tfdist.data.sources import sample_batch

__all__ = ["Dataset", "FileData", "Inputs", "SHUFFLE_BUFFER",
           "SYNTHETIC_EVAL_STEPS", "describe_plan_change", "eval_input_fn",
           "eval_steps", "file_dataset",
           "features_spec", "from_user", "inputs_from_dataset",
           "inputs_from_task", "load", "resolve_sharding", "sample_batch",
           "served_inputs",
           "train_input_fn"]
