"""Shared fixtures: the CLI as a subprocess, and prepared digits data."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=300, env=None, check=True):
  """Runs `python -m tfdist.train ARGS`; returns the CompletedProcess."""
  proc = subprocess.run(
      [sys.executable, "-m", "tfdist.train", *args], cwd=ROOT,
      capture_output=True, text=True, timeout=timeout,
      env={**os.environ, **(env or {})})
  if check and proc.returncode != 0:
    raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n"
                         f"{proc.stderr}")
  return proc


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """digits prepared once for the whole session, through the CLI path."""
  path = str(tmp_path_factory.mktemp("tfds"))
  subprocess.run([sys.executable, "-c",
                  "import sys; from tfdist import digits; "
                  "digits.prepare(sys.argv[1])", path],
                 cwd=ROOT, check=True, capture_output=True)
  return path
