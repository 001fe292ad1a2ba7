"""The per-step cost of the CLI a user runs against the minimal loop.

python -m tools.bench_cli [--rounds=5] [--train_steps=1280]

Each round runs, one after the other, each in a fresh process:
- `python -m tools.minimal_loop`: the hand-written loop (tools.baseline),
  no metrics, no summaries;
- `python -m tfdist.train` with the same model (MLP 64-256-256-10), Adam,
  global batch and steps per call, on the default strategy, with its
  metrics, summaries and progress lines, and no eval or checkpoint until
  the end.
Both are timed the same way: wall time between their progress lines, as
the lines arrive, from the first line (which holds tracing) to the last.
Prints steps/s as median [min-max] and the per-round ratio.
"""

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from . import inprocess

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 5, "Rounds; each runs both contenders.")
flags.DEFINE_integer("train_steps", 1280, "Steps per run.")
flags.DEFINE_integer("batch_size", 256, "Global batch.")
flags.DEFINE_integer("steps_per_loop", 32, "Steps per tf.function call.")
flags.DEFINE_integer("log_every", 128, "Steps between progress lines.")
flags.DEFINE_string("data_dir", "~/tensorflow_datasets", "tfds data_dir.")
flags.DEFINE_list("cli_flags", [], "Extra tfdist.train flags.")

_STEP = re.compile(r"train step (\d+)/\d+")


def steps_per_second(argv, env=None):
  """Steps/s between the first and the last progress line of `argv`."""
  samples = []
  with subprocess.Popen(argv, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True,
                        env={**os.environ, "PYTHONUNBUFFERED": "1",
                             **(env or {})}) as proc:
    for line in proc.stdout:
      found = _STEP.search(line)
      if found:
        samples.append((time.monotonic(), int(found.group(1))))
  if proc.returncode != 0 or len(samples) < 3:
    raise RuntimeError(f"{' '.join(argv[:4])}... exited {proc.returncode} "
                       f"with {len(samples)} progress lines")
  (t0, s0), (t1, s1) = samples[0], samples[-1]
  return (s1 - s0) / (t1 - t0)


def main(argv):
  del argv
  common = [f"--train_steps={FLAGS.train_steps}",
            f"--batch_size={FLAGS.batch_size}",
            f"--steps_per_loop={FLAGS.steps_per_loop}",
            f"--log_every={FLAGS.log_every}"]
  minimal, cli = [], []
  with tempfile.TemporaryDirectory(prefix="tfdist-bench-cli-") as scratch:
    for k in range(FLAGS.rounds):
      minimal.append(steps_per_second(
          [sys.executable, "-m", f"{__package__}.minimal_loop", *common]))
      cli.append(steps_per_second(
          [sys.executable, "-m", "tfdist.train", "--strategy=default",
           "--model=mlp", "--dataset=digits", f"--data_dir={FLAGS.data_dir}",
           f"--model_dir={os.path.join(scratch, str(k))}", "--eval_every=0",
           "--checkpoint_every=0", "--noexport", *common,
           *FLAGS.cli_flags]))
      print(f"round {k + 1}/{FLAGS.rounds}: minimal loop {minimal[-1]:.0f}, "
            f"tfdist.train {cli[-1]:.0f} steps/s", flush=True)
  ratios = [c / m for c, m in zip(cli, minimal)]
  print(f"\nMLP 64-256-256-10, Adam, batch {FLAGS.batch_size}, "
        f"{FLAGS.steps_per_loop} steps per call, {FLAGS.train_steps} steps, "
        f"{FLAGS.rounds} rounds; {os.cpu_count()} CPUs.")
  print("| contender | steps/s, median [min-max] |")
  print("|---|---:|")
  print(f"| minimal loop (tools.minimal_loop) | {inprocess.spread(minimal)} |")
  print(f"| python -m tfdist.train | {inprocess.spread(cli)} |")
  print(f"| tfdist.train / minimal, per round | "
        f"{inprocess.spread(ratios, '{:.3f}')} |")
  return 0 if statistics.median(ratios) > 0 else 1


if __name__ == "__main__":
  app.run(main)
