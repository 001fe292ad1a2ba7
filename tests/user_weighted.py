"""A user's digits classifier with per-example weights, as a user would
write it: numpy arrays (scikit-learn's digits), (features, labels,
sample_weight) datasets. Each Task differs from `Plain` in its weights
only, so tests compare runs that must end with the same weights.
"""

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist import digits

NUM_TRAIN = 1400
# ByClass's per-example weight of each class, and the same as a
# --class_weight flag.
CLASS_WEIGHTS = {c: 0.25 + 0.2 * c for c in range(10)}
CLASS_WEIGHT_FLAG = ",".join(f"{c}:{w:g}" for c, w in CLASS_WEIGHTS.items())


def _arrays():
  images, labels = digits.load()
  images = images.reshape(len(images), -1)
  return (images / 16.0).astype(np.float32), labels.astype(np.int32)


class Plain(tfdist.Task):
  name = "weighted_digits"

  def build_model(self):
    return keras.Sequential([keras.Input((64,)),
                             keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10)])

  def train_weights(self, labels):
    return None

  def eval_weights(self, labels):
    return None

  def eval_examples(self, images, labels):
    return images, labels

  def datasets(self):
    images, labels = _arrays()
    splits = []
    for (x, y), weights in (
        ((images[:NUM_TRAIN], labels[:NUM_TRAIN]), self.train_weights),
        (self.eval_examples(images[NUM_TRAIN:], labels[NUM_TRAIN:]),
         self.eval_weights)):
      w = weights(y)
      splits.append(tf.data.Dataset.from_tensor_slices(
          (x, y) if w is None else (x, y, w.astype(np.float32))))
    return tuple(splits)


class Doubled(Plain):
  """Every example, train and eval, weighs 2."""

  def train_weights(self, labels):
    return np.full(len(labels), 2.0)

  def eval_weights(self, labels):
    return np.full(len(labels), 2.0)


class ByClass(Plain):
  """Train examples weigh CLASS_WEIGHTS[label]; eval is unweighted."""

  def train_weights(self, labels):
    return np.array([CLASS_WEIGHTS[int(y)] for y in labels])


class OddCounted(Plain):
  """Eval examples of even classes weigh 0."""

  def eval_weights(self, labels):
    return (labels % 2).astype(np.float64)


class OddOnly(Plain):
  """Only the eval examples of odd classes."""

  def eval_examples(self, images, labels):
    odd = labels % 2 == 1
    return images[odd], labels[odd]


class MatrixWeights(Plain):
  """A bad input: a sample_weight of shape [2] per example."""

  def train_weights(self, labels):
    return np.ones((len(labels), 2))
