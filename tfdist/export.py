"""SavedModel export through Keras's own ExportArchive.

The archive tracks the model's variables the way TF Serving's loader (and
`saved_model_cli run`) restores them, which a hand-made tf.Module did not.
The `serving_default` signature takes one named input per feature (`images`
for the built-in classification task) and returns the task's named outputs.
"""

import keras
import tensorflow as tf

from tfdist import storage


def serving_spec(features_spec, single_name):
  """Batched TensorSpecs named after the features."""
  def batched(name, spec):
    return tf.TensorSpec([None, *spec.shape], spec.dtype, name=name)
  if isinstance(features_spec, dict):
    return {name: batched(name, spec)
            for name, spec in features_spec.items()}
  return batched(single_name, features_spec)


def export_saved_model(model, *, serving_outputs, features_spec, export_dir,
                       input_name="features"):
  """Writes a SavedModel; the previous export is replaced only on success."""
  # A replace a kill cut short needs its staged tree: finish it first.
  storage.finish_replace(export_dir)
  staging = storage.staging_path(export_dir)
  storage.remove_tree(staging)
  archive = keras.export.ExportArchive()
  archive.track(model)

  def serve(features):
    return serving_outputs(model(features, training=False))

  archive.add_endpoint(
      name="serving_default", fn=serve,
      input_signature=[serving_spec(features_spec, input_name)])
  archive.write_out(staging, verbose=False)
  storage.replace_tree(staging, export_dir)
  return export_dir
