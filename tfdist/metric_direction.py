"""Whether a metric improves downwards or upwards, from its name
(--best_mode=auto). No TensorFlow import: the CLI checks it before
anything starts."""

import re

from tfdist.errors import ConfigError

# The words of the metric names Keras and common tasks use, by the
# direction in which they improve (Keras's own `_direction` is private).
_LOWER_IS_BETTER = frozenset((
    "loss", "error", "mae", "mse", "rmse", "mape", "msle", "perplexity",
    "crossentropy", "hinge", "logcosh", "divergence", "kld", "poisson",
    "wer", "cer"))
_HIGHER_IS_BETTER = frozenset((
    "accuracy", "acc", "auc", "precision", "recall", "f1", "fbeta", "iou",
    "r2", "similarity", "bleu", "rouge", "map"))


def resolve_mode(metric, mode):
  """auto: min or max by the words of the metric's name; ConfigError
  for a name that says neither (or both)."""
  if mode != "auto":
    return mode
  words = set(re.split(r"[^a-z0-9]+", metric.lower()))
  words |= {part for word in words for part in (
      "error", "loss", "crossentropy", "accuracy") if part in word}
  lower, higher = words & _LOWER_IS_BETTER, words & _HIGHER_IS_BETTER
  if bool(lower) == bool(higher):
    raise ConfigError(
        f"--best_mode=auto cannot tell whether {metric} is better lower or "
        f"higher; give --best_mode=min or --best_mode=max. Received: "
        f"best_metric={metric!r}")
  return "min" if lower else "max"
