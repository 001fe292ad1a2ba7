"""SavedModel export with a serving signature."""

import os
import shutil

import tensorflow as tf


class _Serving(tf.Module):

  def __init__(self, model, input_shape):
    super().__init__()
    self.model = model
    spec = tf.TensorSpec([None, *input_shape], tf.float32, name="images")
    self.serve = tf.function(self._serve, input_signature=[spec])

  def _serve(self, images):
    logits = tf.cast(self.model(images, training=False), tf.float32)
    return {"logits": logits,
            "probabilities": tf.nn.softmax(logits),
            "classes": tf.argmax(logits, axis=-1, output_type=tf.int32)}


def export_saved_model(model, *, input_shape, export_dir):
  """Writes a SavedModel; the previous export is replaced only on success."""
  staging = export_dir.rstrip("/") + ".tmp"
  if tf.io.gfile.exists(staging):
    tf.io.gfile.rmtree(staging)
  module = _Serving(model, input_shape)
  tf.saved_model.save(module, staging,
                      signatures={"serving_default": module.serve})
  if tf.io.gfile.exists(export_dir):
    shutil.rmtree(export_dir)
  os.replace(staging, export_dir)
  return export_dir
