"""Run a launcher job and time it; shared by the multi-process benchmarks."""

import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_job(launcher_args, train_args, *, steps, prefix=()):
  """Runs `launch.local` for `steps` steps in a fresh model_dir.

  `prefix` wraps the command (e.g. `ip netns exec NS`). Returns seconds.
  """
  with tempfile.TemporaryDirectory() as model_dir:
    argv = [*prefix, sys.executable, "-m", "launch.local", *launcher_args,
            "--", *train_args, f"--train_steps={steps}",
            f"--model_dir={model_dir}", "--eval_every=0",
            "--checkpoint_every=0", "--noexport", "--log_every=1000000"]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
  if proc.returncode:
    sys.exit(f"job failed:\n{proc.stdout[-3000:]}")
  return seconds


def steps_per_second(launcher_args, train_args, *, short, long):
  """Per-step rate from two run lengths: start-up and teardown cancel."""
  fast = run_job(launcher_args, train_args, steps=short)
  slow = run_job(launcher_args, train_args, steps=long)
  return (long - short) / max(slow - fast, 1e-9)
