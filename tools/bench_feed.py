"""Benchmark: the train feed of a real MWMS job, TF's distributed iterator
against tfdist's plain one (--train_feed=distributed vs auto).

python -m tools.bench_feed [--rounds=3] [--workers=2] [--steps=300]

Each round runs the same job twice, one feed after the other (so a slow
spell of the shared machine hits both alike): `launch.local --workers=N
--isolate=off` of `python -m tfdist.train --model=mlp_wide
--dataset=digits`, global batch 64. Steps/s is read from the chief's own
progress lines after the first interval (start-up and tracing excluded).
Prints each round, then the median [min-max] of each feed and of the
per-round ratio.
"""

import re
import statistics
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")
flags.DEFINE_integer("workers", 2, "MWMS worker processes.")
flags.DEFINE_integer("steps", 300, "Train steps per job.")
flags.DEFINE_integer("log_every", 50, "Steps per progress line.")
flags.DEFINE_string("model", "mlp_wide", "Zoo model.")
flags.DEFINE_integer("batch_size", 64, "Global batch.")

FEEDS = ("distributed", "auto")
_LINE = re.compile(r"^worker:0 \| \S+ train step (\d+)/\d+: .* "
                   r"([0-9.]+) examples/s")


def steps_per_second(output, *, batch_size, log_every):
  """Mean steps/s over the chief's progress lines after the first."""
  rates = [float(m.group(2)) / batch_size
           for m in map(_LINE.match, output.splitlines())
           if m and int(m.group(1)) > log_every]
  if not rates:
    raise RuntimeError("no progress lines:\n" + output[-2000:])
  return statistics.mean(rates)


def run_job(feed, data_dir, model_dir):
  proc = subprocess.run(
      [sys.executable, "-m", "launch.local", f"--workers={FLAGS.workers}",
       "--isolate=off", "--", "--strategy=multi_worker_mirrored",
       f"--model={FLAGS.model}", "--dataset=digits",
       f"--data_dir={data_dir}", f"--model_dir={model_dir}",
       f"--batch_size={FLAGS.batch_size}", f"--train_steps={FLAGS.steps}",
       f"--log_every={FLAGS.log_every}",
       f"--steps_per_loop={FLAGS.log_every}", "--eval_every=0",
       "--checkpoint_every=0", "--export=false", f"--train_feed={feed}"],
      capture_output=True, text=True, timeout=1800)
  if proc.returncode != 0:
    raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-2000:])
  return steps_per_second(proc.stdout, batch_size=FLAGS.batch_size,
                          log_every=FLAGS.log_every)


def _summary(values):
  return (f"{statistics.median(values):.2f} "
          f"[{min(values):.2f}-{max(values):.2f}]")


def main(argv):
  del argv
  results = {feed: [] for feed in FEEDS}
  with tempfile.TemporaryDirectory() as scratch:
    for round_index in range(FLAGS.rounds):
      for feed in FEEDS:
        rate = run_job(feed, f"{scratch}/data",
                       f"{scratch}/run-{round_index}-{feed}")
        results[feed].append(rate)
        print(f"round {round_index + 1}: --train_feed={feed}: "
              f"{rate:.2f} steps/s", flush=True)
  ratios = [a / d for a, d in zip(results["auto"], results["distributed"])]
  print(f"\n{FLAGS.model}, {FLAGS.workers} MWMS workers, global batch "
        f"{FLAGS.batch_size}, {FLAGS.rounds} rounds (median [min-max]):")
  for feed in FEEDS:
    print(f"  --train_feed={feed:<12} {_summary(results[feed])} steps/s")
  print(f"  auto / distributed     {_summary(ratios)}x")


if __name__ == "__main__":
  app.run(main)
