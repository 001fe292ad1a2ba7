"""`digits`: the 1,797 8x8 handwritten digits of the UCI ML repository, as
scikit-learn ships them, as a tfds dataset.

tfdist ships the same file (data_files/digits.csv.gz: E. Alpaydin and C.
Kaynak's test set of "Optical Recognition of Handwritten Digits", CC BY
4.0), so preparing it needs no network and no scikit-learn, whose import
Keras would otherwise pay at every start.
"""

import contextlib
import fcntl
import gzip
import io
import os
import tempfile

import numpy as np
import tensorflow_datasets as tfds

TEST_FRACTION = 0.2
NUM_SHARDS = 4  # Several TFRecord files per split, so file sharding works.


_CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                    "data_files", "digits.csv.gz")


def load():
  """(images, labels): float images of shape (1797, 8, 8) with pixels
  0..16 and int labels, in the file's order (scikit-learn's
  `load_digits()` images and target)."""
  with gzip.open(_CSV, "rt") as f:
    table = np.loadtxt(f, delimiter=",")
  return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


def _split_arrays(split):
  images, labels = load()
  # Pixels are 0..16; store them as 0..255 uint8 images.
  images = np.round(images * (255.0 / 16.0)).astype(np.uint8)
  order = np.random.RandomState(0).permutation(len(images))
  num_test = int(round(len(images) * TEST_FRACTION))
  chosen = order[:num_test] if split == "test" else order[num_test:]
  return images[chosen, :, :, None], labels[chosen]


class Digits(tfds.core.GeneratorBasedBuilder):
  """scikit-learn's handwritten digits, 8x8 grey images, 10 classes."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        description="UCI ML handwritten digits (the copy scikit-learn "
        "ships).",
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(8, 8, 1)),
            "label": tfds.features.ClassLabel(num_classes=10),
        }),
        supervised_keys=("image", "label"),
        homepage="https://scikit-learn.org/stable/datasets/toy_dataset.html",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    return {split: self._generate_examples(split)
            for split in ("train", "test")}

  def _generate_examples(self, split):
    images, labels = _split_arrays(split)
    for index, (image, label) in enumerate(zip(images, labels)):
      yield f"{split}-{index}", {"image": image, "label": int(label)}


@contextlib.contextmanager
def tfds_temp_dirs_removed():
  """tfds makes an empty temporary directory for the GCS metadata of a
  dataset not prepared yet, and never removes it: one per fresh
  data_dir. Temporary files made meanwhile go in one that is removed
  (digits here, and a catalog dataset's builder)."""
  with tempfile.TemporaryDirectory(prefix="tfdist-digits-") as scratch:
    previous, tempfile.tempdir = tempfile.tempdir, scratch
    try:
      yield
    finally:
      tempfile.tempdir = previous


def prepare(data_dir):
  """Prepares `digits` in `data_dir` (a no-op once done) and returns it.

  A file lock makes the tasks of a local cluster, which all start at once,
  prepare it one after the other instead of racing.
  """
  os.makedirs(data_dir, exist_ok=True)
  with open(os.path.join(data_dir, ".digits.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    with tfds_temp_dirs_removed():
      builder = Digits(data_dir=data_dir)
    # tfds prints "Downloading ..." to stdout; nothing is downloaded here.
    with contextlib.redirect_stdout(io.StringIO()):
      builder.download_and_prepare(
          download_config=tfds.download.DownloadConfig(num_shards=NUM_SHARDS))
  return builder
