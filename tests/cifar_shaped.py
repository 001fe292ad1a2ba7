"""CIFAR-shaped data that a ResNet can learn in a few hundred steps:
--dataset=tests.cifar_shaped:data.

32x32x3 images in 10 classes. Each class has a smooth colour pattern (a
random 4x4x3 grid, upsampled); an image is its class pattern at a random
contrast and a random shift of up to 4 pixels, under Gaussian noise. The
labels follow the images, unlike the built-in `synthetic` data, so
accuracy means something; the noise keeps it away from 100%.
"""

import numpy as np
import tensorflow as tf

NUM_CLASSES, NUM_TRAIN, NUM_EVAL = 10, 4096, 1024
NOISE, MAX_SHIFT = 3.0, 4


def _patterns(rng):
  coarse = rng.normal(size=(NUM_CLASSES, 4, 4, 3)).astype(np.float32)
  return tf.image.resize(coarse, (32, 32), method="bilinear").numpy()


def _examples(patterns, size, rng):
  labels = rng.integers(0, NUM_CLASSES, size=size).astype(np.int32)
  contrast = rng.uniform(0.5, 1.5, size=(size, 1, 1, 1)).astype(np.float32)
  images = patterns[labels] * contrast
  shifts = rng.integers(-MAX_SHIFT, MAX_SHIFT + 1, size=(size, 2))
  for i, (dy, dx) in enumerate(shifts):
    images[i] = np.roll(images[i], (dy, dx), axis=(0, 1))
  images += NOISE * rng.normal(size=images.shape).astype(np.float32)
  return images, labels


def data():
  """(train, eval): unbatched (image, label) datasets."""
  rng = np.random.default_rng(0)
  patterns = _patterns(rng)
  train = _examples(patterns, NUM_TRAIN, rng)
  test = _examples(patterns, NUM_EVAL, rng)
  return (tf.data.Dataset.from_tensor_slices(train),
          tf.data.Dataset.from_tensor_slices(test))
