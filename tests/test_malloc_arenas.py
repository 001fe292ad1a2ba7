"""tfdist.malloc_arenas: the cap on glibc's malloc arenas a run sets."""

import subprocess
import sys

from conftest import ROOT

from tfdist import config as config_lib
from tfdist import malloc_arenas

_PROBE = """
import sys
from tfdist import malloc_arenas
print(malloc_arenas.limit(int(sys.argv[1])))
"""


def _config(**flags):
  return config_lib.Config(model_dir="unused", **flags)


def test_the_default_caps_only_sharded_parameters():
  assert malloc_arenas.count(_config(shard="params")) == 2
  assert malloc_arenas.count(_config(shard="optimizer")) == 0
  assert malloc_arenas.count(_config()) == 0
  assert malloc_arenas.count(_config(malloc_arenas=4)) == 4


def test_glibc_takes_the_cap():
  # A process of its own: the cap lasts as long as the process.
  def probe(count):
    return subprocess.run([sys.executable, "-c", _PROBE, str(count)],
                          cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
  assert probe(2) == "True"
