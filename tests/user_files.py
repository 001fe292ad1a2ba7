"""A user's TFRecord files and a model that says what it trained on, as
tfdist has never seen them (tests/test_file_runs.py copies this module
outside the repository):
- `write(root)`: NUM_FILES train files and two eval files of tf.Examples,
  each with an integer `id`, features `x` made from it and a class label;
- `data()`: a tfdist.FileData over the files under $USER_FILES (written
  first when that is a ram:// prefix, since ram:// lives in one process);
- `build()`: a compiled Keras model that, while training, appends the ids
  of each batch it trains on to $USER_IDS_DIR/ids-PID.txt (a py_function:
  what a step really consumed, not what the input read ahead); on
  parameter-server workers, where a py_function cannot run, with
  $USER_WORKER_IDS set, a line "worker-index [ids]" per batch appended
  to that file by the worker (tf.print).
"""

import dataclasses
import json
import os
import time

import keras
import numpy as np
import tensorflow as tf

import tfdist

NUM_FILES, PER_FILE, NUM_EVAL, NUM_CLASSES = 8, 64, 40, 3
FILES_ENV, IDS_ENV, SLEEP_ENV = "USER_FILES", "USER_IDS_DIR", "USER_SLEEP"
WORKER_IDS_ENV = "USER_WORKER_IDS"


def _features(ids):
  ids = np.asarray(ids, np.float32)
  return np.stack([np.sin(ids), np.cos(ids), (ids % 5) / 5, (ids % 7) / 7],
                  axis=-1).astype(np.float32)


def _label(i):
  return int(i % 7) % NUM_CLASSES


def _example(i):
  feature = {
      "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
      "x": tf.train.Feature(float_list=tf.train.FloatList(
          value=_features([i])[0])),
      "label": tf.train.Feature(int64_list=tf.train.Int64List(
          value=[_label(i)]))}
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString()


def _write(path, ids):
  with tf.io.TFRecordWriter(path) as writer:
    for i in ids:
      writer.write(_example(int(i)))


def write(root, num_files=NUM_FILES, per_file=PER_FILE):
  """Train ids 0 .. num_files * per_file - 1, file f holding a block of
  them; eval ids from 100000 on."""
  tf.io.gfile.makedirs(root)
  for f in range(num_files):
    _write(f"{root}/train-{f:05d}.tfrecord",
           range(f * per_file, (f + 1) * per_file))
  for f in range(2):
    _write(f"{root}/eval-{f:05d}.tfrecord",
           range(100000 + f * NUM_EVAL // 2, 100000 + (f + 1) * NUM_EVAL // 2))


def parse(record):
  example = tf.io.parse_single_example(record, {
      "id": tf.io.FixedLenFeature([], tf.int64),
      "x": tf.io.FixedLenFeature([4], tf.float32),
      "label": tf.io.FixedLenFeature([], tf.int64)})
  return {"x": example["x"], "id": example["id"]}, example["label"]


def data():
  root = os.environ[FILES_ENV]
  if root.startswith("ram://"):
    write(root)
  return tfdist.FileData(train=f"{root}/train-*.tfrecord",
                         eval=f"{root}/eval-*.tfrecord", parse=parse,
                         num_classes=NUM_CLASSES)


def _append(ids):
  with open(os.path.join(os.environ[IDS_ENV], f"ids-{os.getpid()}.txt"),
            "a") as out:
    out.write(" ".join(str(int(i)) for i in ids.numpy()) + "\n")
  time.sleep(float(os.environ.get(SLEEP_ENV, "0")))
  return np.int64(0)


class LogIds(keras.layers.Layer):
  """Passes x through; while training, logs the batch's ids first."""

  def call(self, x, ids, training=None):
    if training and os.environ.get(WORKER_IDS_ENV):
      printed = tf.print(
          tf.distribute.coordinator.experimental_get_current_worker_index(),
          ids, summarize=-1,
          output_stream=f"file://{os.environ[WORKER_IDS_ENV]}")
      with tf.control_dependencies([printed]):
        return tf.identity(x)
    if not (training and os.environ.get(IDS_ENV)):
      return x
    logged = tf.py_function(_append, [ids], tf.int64)
    with tf.control_dependencies([logged]):
      return tf.identity(x)


def build():
  x = keras.Input((4,), name="x")
  ids = keras.Input((), dtype="int64", name="id")
  hidden = keras.layers.Dense(16, activation="relu", name="hidden")(
      LogIds(name="log_ids")(x, ids))
  logits = keras.layers.Dense(NUM_CLASSES, name="logits")(hidden)
  model = keras.Model({"x": x, "id": ids}, logits)
  model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True), metrics=["accuracy"])
  return model


def bad_pattern():
  return tfdist.FileData(train="/nonexistent/tfdist/train-*",
                         eval="/nonexistent/tfdist/eval-*", parse=parse)


def bad_parse():
  """A parse that names a feature the records do not have."""
  def wrong(record):
    example = tf.io.parse_single_example(
        record, {"pixels": tf.io.FixedLenFeature([4], tf.float32)})
    return example["pixels"], tf.constant(0)
  data_ = data()
  return tfdist.FileData(train=data_.train, eval=data_.eval, parse=wrong)


def python_parse():
  """A parse that calls Python, which the tf.data service cannot ship."""
  data_ = data()

  def through_python(record):
    features, label = parse(record)
    x = tf.py_function(lambda v: v, [features["x"]], tf.float32)
    x.set_shape([4])
    return {"x": x, "id": features["id"]}, label
  return tfdist.FileData(train=data_.train, eval=data_.eval,
                         parse=through_python, num_classes=NUM_CLASSES)


def jittered():
  """data() with an augment that takes a seed: stateless draws, keyed by
  the example's place in its stream."""
  def jitter(features, label, seed):
    noise = tf.random.stateless_uniform([4], seed, -0.05, 0.05)
    return {"x": features["x"] + noise, "id": features["id"]}, label
  data_ = data()
  return tfdist.FileData(train=data_.train, eval=data_.eval, parse=parse,
                         augment=jitter, num_classes=NUM_CLASSES)


def hand_built():
  """The same files as data(), read by a tf.data pipeline of the user's
  own (train, eval)."""
  root = os.environ[FILES_ENV]
  return tuple(
      tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(
          f"{root}/{split}-*.tfrecord"))).map(parse)
      for split in ("train", "eval"))


def one_file_short():
  """data() on all workers but worker 1, which does not see the last
  train file (a local disk, or a shard still being written)."""
  data_ = data()
  task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
  if task.get("type") == "worker" and task.get("index") == 1:
    root = os.environ[FILES_ENV]
    return dataclasses.replace(data_, train=[
        f"{root}/train-{f:05d}.tfrecord" for f in range(NUM_FILES - 1)])
  return data_


def slow_augment():
  """An augment that sleeps 4 ms per example (in Python): a run whose
  steps wait for their input."""
  data_ = data()

  def slow(features, label):
    delayed = tf.py_function(lambda v: (time.sleep(0.004), v)[1],
                             [features["x"]], tf.float32)
    delayed.set_shape([4])
    return {"x": delayed, "id": features["id"]}, label
  return tfdist.FileData(train=data_.train, eval=data_.eval, parse=parse,
                         augment=slow, num_classes=NUM_CLASSES)
