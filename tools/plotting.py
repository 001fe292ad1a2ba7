"""matplotlib for the tools that draw plots, which is an extra: Keras
imports matplotlib at every start wherever it is installed."""

import sys


def pyplot():
  """matplotlib.pyplot drawing to files, or one line and exit 2 when
  matplotlib is not installed."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    sys.stderr.write("tfdist: error: plots need matplotlib: pip install -e "
                     "'.[plots]'\n")
    sys.exit(2)
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt
