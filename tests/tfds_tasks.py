"""Tasks over tfds catalog datasets, read offline through
tfds.testing.mock_data (random examples with the real features):
`cifar10` (images) and `imdb` (text, hashed into token ids)."""

import keras
import tensorflow as tf
import tensorflow_datasets as tfds

import tfdist
from tfdist import digits

MOCK_EXAMPLES = 96
TOKENS, BUCKETS = 16, 1000


def _load(name):
  # tfds leaves an empty temporary directory per load of a dataset that
  # is not prepared: this module's are removed (tools.leftovers).
  with digits.tfds_temp_dirs_removed(), tfds.testing.mock_data(
      num_examples=MOCK_EXAMPLES):
    return tfds.load(name, split=["train", "test"], as_supervised=True)


class Cifar10(tfdist.Task):
  name = "cifar10"

  def build_model(self):
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10)])

  def datasets(self):
    normalize = lambda image, label: (  # noqa: E731
        tf.cast(image, tf.float32) / 255.0, tf.cast(label, tf.int32))
    train, test = _load("cifar10")
    return train.map(normalize), test.map(normalize)


def _token_ids(text, label):
  words = tf.strings.split(tf.strings.lower(text))
  ids = tf.strings.to_hash_bucket_fast(words, BUCKETS)[:TOKENS]
  ids = tf.pad(ids, [[0, TOKENS - tf.shape(ids)[0]]])
  return {"tokens": tf.ensure_shape(ids, [TOKENS])}, tf.cast(label, tf.int32)


class Imdb(tfdist.Task):
  name = "imdb_reviews"

  def build_model(self):
    tokens = keras.Input((TOKENS,), dtype="int64", name="tokens")
    x = keras.layers.Embedding(BUCKETS, 8)(tokens)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model({"tokens": tokens}, keras.layers.Dense(2)(x))

  def datasets(self):
    train, test = _load("imdb_reviews")
    return train.map(_token_ids), test.map(_token_ids)
