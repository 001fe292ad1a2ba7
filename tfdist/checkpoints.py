"""Checkpoints in model_dir: resume, fall back past corrupt ones, never
overwrite a checkpoint of a different model."""

import contextlib
import json

from absl import logging
import tensorflow as tf

from tfdist import errors
from tfdist import runners
from tfdist import storage
from tfdist.errors import CheckpointError

SIGNATURE_FILE = "tfdist_model.json"
# What the last run that saved here was asked for (its schedule), so a
# resume can say what changed.
RUN_FILE = "tfdist_run.json"
BEST_DIR = "best_checkpoint"  # --best_metric: the best eval's checkpoint.
BEST_FILE = "best.json"
BEST_CHECKPOINT_KEY = "checkpoint"  # In best.json: the kept checkpoint.
# A survivor's state after a lost peer (tfdist.survivor), one per task.
SURVIVORS_DIR = "survivors"
# What reading a truncated or corrupt checkpoint raises.
UNREADABLE = (tf.errors.OpError, IndexError, OSError, EOFError)


def read_json(model_dir, name):
  """A JSON file tfdist wrote in model_dir, or None."""
  return storage.read_json(storage.join(model_dir, name))


def kept_record_counts(model_dir):
  """The record counts an earlier run of model_dir kept (or None): a
  resume need not count its files again. A record that does not parse
  only costs a count."""
  try:
    record = read_json(model_dir, RUN_FILE) or {}
  except (ValueError, tf.errors.OpError):
    return None
  counts = record.get("record_counts") if isinstance(record, dict) else None
  return counts if isinstance(counts, dict) else None


def model_signature(*, model_name, model, num_classes=None):
  """What must match for a checkpoint to be restored into this model."""
  return {
      "model": model_name,
      "num_classes": None if num_classes is None else int(num_classes),
      "variables": {v.path: list(v.shape) for v in model.weights},
  }


def _describe_mismatch(saved, wanted):
  if saved["model"] != wanted["model"]:
    return f"model {saved['model']!r}, not {wanted['model']!r}"
  if saved["num_classes"] != wanted["num_classes"]:
    return (f"{saved['num_classes']} classes, not "
            f"{wanted['num_classes']}")
  for name, shape in wanted["variables"].items():
    if saved["variables"].get(name) != shape:
      return (f"variable {name} with shape {saved['variables'].get(name)}, "
              f"not {shape}")
  return "different variables"


def _step_of(path):
  """N of a checkpoint prefix .../ckpt-N (-1 for another name)."""
  tail = path.rsplit("-", 1)[-1]
  return int(tail) if tail.isdigit() else -1


class CheckpointStore:
  """Wraps tf.train.CheckpointManager for one model_dir."""

  def __init__(self, *, objects, model_dir, write_dir, keep, signature,
               optional=None, run_record=None,
               saving=contextlib.nullcontext):
    """`objects`: {name: trackable}, what a checkpoint must hold to be
    restored. `optional`: {name: trackable}, saved too, and restored when
    a checkpoint holds it (one written before it was kept still
    restores). `saving()`: a context around each save (a sharded
    optimizer gathers its state in it); what it gives, if anything, is
    called with the checkpoint's path once TF has written it, before it
    is named the latest (tfdist.piecewise_save)."""
    self._optional = dict(optional or {})
    self._required = tf.train.Checkpoint(**objects)
    checkpoint = tf.train.Checkpoint(**objects, **self._optional)
    self._checkpoint = checkpoint
    self._saving = saving
    self._model_dir = model_dir
    self._signature = signature
    self._run_record = run_record
    self._previous_run = self._read_json(RUN_FILE)
    self._restored_path = None
    self._write_dir = write_dir
    self._reader = tf.train.CheckpointManager(checkpoint, model_dir,
                                              max_to_keep=keep)
    self._manager = (self._reader if write_dir == model_dir else
                     tf.train.CheckpointManager(checkpoint, write_dir,
                                                max_to_keep=1))

  def _check_signature(self):
    saved = self._read_json(SIGNATURE_FILE)
    if saved is not None and saved != self._signature:
      raise CheckpointError(
          f"model_dir {self._model_dir} holds checkpoints of "
          f"{_describe_mismatch(saved, self._signature)}; use another "
          "--model_dir (nothing was changed).")

  def restore(self):
    """Restores the newest usable checkpoint; returns its path or None."""
    self._check_signature()
    managed = list(reversed(self._reader.checkpoints))
    candidates = self._newer_survivor_states(managed) + managed
    for path in candidates:
      try:
        # Partial: the optional objects are restored next (and a run
        # without them would warn of them at exit).
        self._required.restore(
            path).assert_existing_objects_matched().expect_partial()
        if self._optional:
          tf.train.Checkpoint(**self._optional).restore(path).expect_partial()
        self._restored_path = path
        return path
      except UNREADABLE as e:
        logging.warning("Checkpoint %s is unreadable (%s); trying the one "
                        "before it.", path, errors.first_line(e))
      except (AssertionError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {path} does not match the requested model "
            f"({errors.first_line(e)}); use another --model_dir "
            "(nothing was changed).") from None
    if candidates:
      raise CheckpointError(
          f"no readable checkpoint in {self._model_dir} (tried "
          f"{len(candidates)}); nothing was changed.")
    return None

  def read_again(self):
    """Restores the checkpoint restore() restored, again (a sharded run's
    chief reads its entries whole to send them: tfdist.params_checkpoint)."""
    try:
      self._required.restore(self._restored_path).expect_partial()
    except UNREADABLE as e:
      raise CheckpointError(
          f"checkpoint {self._restored_path} could not be read again to "
          f"send it to the other workers ({errors.first_line(e)}); nothing "
          "was changed.") from None

  def _newer_survivor_states(self, managed):
    """Survivor states newer than the newest checkpoint, newest first."""
    newest = _step_of(managed[0]) if managed else -1
    found = tf.io.gfile.glob(storage.join(
        self._model_dir, SURVIVORS_DIR, "*", "ckpt-*.index"))
    paths = [p[:-len(".index")] for p in found]
    return sorted((p for p in paths if _step_of(p) > newest),
                  key=_step_of, reverse=True)

  def is_survivor_state(self, path):
    # By prefix: a model_dir may itself have "survivors" in its path.
    prefix = storage.join(self._model_dir, SURVIVORS_DIR) + "/"
    return bool(path) and path.startswith(prefix)

  def write_survivor(self, task_name, step):
    """Writes the state now in the variables as this task's survivor
    state at `step`, with no collective; returns its path."""
    directory = storage.join(self._model_dir, SURVIVORS_DIR,
                             task_name.replace(":", "-"))
    storage.remove_tree(directory)  # An older state of this task.
    # Made if need be, so that it restores as a managed checkpoint does.
    _ = self._checkpoint.save_counter
    return self._checkpoint.write(storage.join(directory, f"ckpt-{step}"))

  def remove_survivor_states(self):
    """The chief, once the restored state is a checkpoint: survivors/ is
    spent (older, or saved)."""
    if self._write_dir == self._model_dir:
      storage.remove_tree(storage.join(self._model_dir, SURVIVORS_DIR))

  def restore_for_eval(self, path=None):
    """Restores what evaluation needs from `path` (default: the latest
    checkpoint in model_dir); returns the path. Writes nothing."""
    self._check_signature()
    path = path or self._reader.latest_checkpoint
    if path is None:
      raise CheckpointError(f"no checkpoint in {self._model_dir} to "
                            "evaluate; nothing was changed.")
    try:
      self._checkpoint.restore(path).expect_partial()
    except UNREADABLE as e:
      raise CheckpointError(
          f"checkpoint {path} is unreadable "
          f"({errors.first_line(e)}); nothing was changed.") from None
    return path

  def new_checkpoints(self, timeout_seconds):
    """Restores each new checkpoint in model_dir as it appears (sidecar
    evaluation), skipping unreadable ones; yields their paths."""
    for path in tf.train.checkpoints_iterator(
        self._model_dir, min_interval_secs=1, timeout=timeout_seconds):
      try:
        # The optimizer may be absent or partial: read what the model needs.
        self._checkpoint.restore(path).expect_partial()
      except UNREADABLE as e:
        logging.warning("Skipping unreadable checkpoint %s (%s).", path,
                        errors.first_line(e))
        continue
      yield path

  def save(self, step):
    """Saves at `step`. Every worker calls it; only the chief's is kept.

    A save that fails (a full disk) leaves no partial checkpoint: TF
    writes into a `_temp` directory and only then makes it the latest, so
    the temp directory is removed and the previous checkpoint stays latest.
    """
    try:
      with self._saving() as write_rest:
        # A sharded run writes its sharded entries after TF's save and
        # before the manager names the checkpoint the latest.
        options = write_rest and tf.train.CheckpointOptions(
            experimental_write_callbacks=[write_rest])
        path = self._manager.save(checkpoint_number=step, options=options)
    except (tf.errors.OpError, OSError) as e:
      if runners.is_collective_failure(e):
        raise  # A peer lost in a sharded save's gather: not the disk.
      storage.remove_tree(storage.join(self._write_dir, f"ckpt-{step}_temp"))
      reason = getattr(e, "message", None) or str(e)
      reason = reason.splitlines()[0].rsplit(";", 1)[-1].strip()[:120]
      raise CheckpointError(
          f"could not write checkpoint {self._write_dir}/ckpt-{step} "
          f"({reason}); the previous checkpoint "
          f"{self._manager.latest_checkpoint or '(none)'} is still the "
          "latest. Free space and run the same command to resume.") from None
    if self._write_dir == self._model_dir:
      if not tf.io.gfile.exists(storage.join(self._model_dir,
                                             SIGNATURE_FILE)):
        self._write_json(SIGNATURE_FILE, self._signature)
      if self._run_record is not None:
        self._write_json(RUN_FILE, self._run_record)
    return path

  def keep_best(self, path, state):
    """Copies checkpoint `path` to model_dir/best_checkpoint, with `state`
    in best.json: --keep_checkpoints never deletes it. The chief's copy
    only (other workers write nowhere shared).

    The new checkpoint's files go in beside the old one's; then best.json,
    which names the checkpoint with its state, is replaced (one renamed
    file: the commit); then the `checkpoint` index follows it, and only
    then do the old files go. A kill before the index is rewritten is
    mended where the best is read back (read_best_state)."""
    if self._write_dir != self._model_dir:
      return None
    best_dir = storage.join(self._model_dir, BEST_DIR)
    tf.io.gfile.makedirs(best_dir)
    prefix = path.rsplit("/", 1)[-1]
    self._copy_or_write(path, best_dir)
    self._write_json(storage.join(BEST_DIR, BEST_FILE),
                     {**state, BEST_CHECKPOINT_KEY: prefix})
    self._write_best_index(prefix)
    for old in tf.io.gfile.glob(storage.join(best_dir, "ckpt-*")):
      if not old.rsplit("/", 1)[-1].startswith(f"{prefix}."):
        tf.io.gfile.remove(old)
    return storage.join(best_dir, prefix)

  def _write_best_index(self, prefix):
    storage.write_text(storage.join(self._model_dir, BEST_DIR, "checkpoint"),
                       f'model_checkpoint_path: "{prefix}"\n'
                       f'all_model_checkpoint_paths: "{prefix}"\n')

  def _copy_or_write(self, path, directory):
    """Copies checkpoint `path`'s files into `directory`; if the training
    run's --keep_checkpoints removed them meanwhile (a sidecar evaluates
    behind the run), writes the state this process restored from it."""
    prefix = path.rsplit("/", 1)[-1]
    try:
      sources = tf.io.gfile.glob(f"{path}.*")
      if f"{path}.index" not in sources:
        raise tf.errors.NotFoundError(None, None, f"{path}.index")
      for source in sources:
        storage.copy_file(source, storage.join(
            directory, source.rsplit("/", 1)[-1]))
    except tf.errors.NotFoundError:
      logging.info("%s was removed before it could be kept as the best; "
                   "writing the weights restored from it.", path)
      self._checkpoint.write(storage.join(directory, prefix))

  def update_best_state(self, state):
    """Rewrites best.json (the count of evals without improvement),
    naming the same checkpoint."""
    if self._write_dir != self._model_dir:
      return
    kept = self._read_json(storage.join(BEST_DIR, BEST_FILE))
    if kept is not None:
      self._write_json(storage.join(BEST_DIR, BEST_FILE), {
          **state, BEST_CHECKPOINT_KEY: kept.get(BEST_CHECKPOINT_KEY)})

  def read_best_state(self, *, mend=False):
    """best.json of an earlier run here, or None. `mend` (the keeper of
    the best, as it starts: no one else writes it then): point the
    `checkpoint` index at the checkpoint best.json names, if a kill came
    between the two writes."""
    state = self._read_json(storage.join(BEST_DIR, BEST_FILE))
    prefix = (state or {}).get(BEST_CHECKPOINT_KEY)
    best_dir = storage.join(self._model_dir, BEST_DIR)
    if mend and prefix and self._write_dir == self._model_dir and (
        tf.train.latest_checkpoint(best_dir) != storage.join(best_dir,
                                                             prefix)):
      self._write_best_index(prefix)
    return state

  @property
  def run_record(self):
    """What this run writes beside its checkpoints."""
    return self._run_record or {}

  @property
  def previous_run(self):
    """The run record of the run that saved here last, or None."""
    return self._previous_run

  def _read_json(self, name):
    return read_json(self._model_dir, name)

  def _write_json(self, name, value):
    storage.write_text(storage.join(self._model_dir, name),
                       json.dumps(value, indent=1, sort_keys=True))
