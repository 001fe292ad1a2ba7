"""tfdist: one trainer for every tf.distribute strategy."""

__version__ = "0.1.0"
