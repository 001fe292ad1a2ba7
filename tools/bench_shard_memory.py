"""Optimizer-state bytes per replica against N, sharded or not, measured
from the runs' own TensorBoard scalars (optimizer_bytes/<device>).

python -m tools.bench_shard_memory [--replicas=1,2,4,8] [--model=mlp_wide]
    [--optimizer=adam] [--plot=docs/shard_memory.png]

For each N, `python -m tfdist.train --strategy=mirrored
--num_cpu_devices=N` runs 2 steps on digits, with and without
--shard_optimizer, in a fresh model_dir. Prints a table (MB on the first
replica's device, and the ratio to the unsharded run) and, with --plot,
draws both lines.
"""

import argparse
import os
import subprocess
import sys
import tempfile

from . import plotting


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m tools.bench_shard_memory")
  parser.add_argument("--replicas", default="1,2,4,8")
  parser.add_argument("--model", default="mlp_wide")
  parser.add_argument("--optimizer", default="adam")
  parser.add_argument("--plot", default="")
  args = parser.parse_args(argv)
  try:
    args.replicas = [int(n) for n in args.replicas.split(",")]
  except ValueError:
    parser.error(f"--replicas takes N,N,... Received: {args.replicas}")
  if not args.replicas or any(n < 1 or 64 % n for n in args.replicas):
    parser.error("every --replicas count must be >= 1 and divide the "
                 f"batch of 64. Received: {args.replicas}")
  return args


def _state_bytes(model_dir):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  path = os.path.join(model_dir, "train")
  for name in sorted(os.listdir(path)):
    for event in tf.compat.v1.train.summary_iterator(os.path.join(path,
                                                                  name)):
      for value in event.summary.value:
        if value.tag == "optimizer_bytes/CPU:0":
          return float(tf.make_ndarray(value.tensor))
  raise RuntimeError(f"no optimizer_bytes/CPU:0 in {path}")


def _run(root, data_dir, args, replicas, sharded):
  model_dir = os.path.join(root, f"n{replicas}{'s' if sharded else ''}")
  subprocess.run(
      [sys.executable, "-m", "tfdist.train", f"--model_dir={model_dir}",
       f"--data_dir={data_dir}", f"--model={args.model}",
       f"--optimizer={args.optimizer}", "--strategy=mirrored",
       f"--num_cpu_devices={replicas}", "--train_steps=2",
       "--steps_per_loop=1", "--eval_every=0", "--noexport",
       "--batch_size=64", *(["--shard_optimizer"] if sharded else [])],
      check=True, capture_output=True)
  return _state_bytes(model_dir)


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  # Before the runs, so a missing matplotlib costs no minutes.
  pyplot = plotting.pyplot() if args.plot else None
  rows = []
  with tempfile.TemporaryDirectory(prefix="tfdist-shard-memory-") as root:
    data_dir = os.path.join(root, "data")
    subprocess.run([sys.executable, "-c", "import sys; from tfdist import "
                    "digits; digits.prepare(sys.argv[1])", data_dir],
                   check=True, capture_output=True)
    for n in args.replicas:
      plain, sharded = (_run(root, data_dir, args, n, s)
                        for s in (False, True))
      rows.append((n, plain, sharded))
      print(f"N={n}: unsharded {plain / 1e6:.2f} MB, sharded "
            f"{sharded / 1e6:.2f} MB per replica ({sharded / plain:.3f}x)",
            flush=True)
  print(f"\n{args.model}, {args.optimizer}, optimizer state on each "
        "replica's device (optimizer_bytes/CPU:0):")
  print("| replicas N | unsharded MB | --shard_optimizer MB | ratio | 1/N |")
  print("|---:|---:|---:|---:|---:|")
  for n, plain, sharded in rows:
    print(f"| {n} | {plain / 1e6:.2f} | {sharded / 1e6:.2f} | "
          f"{sharded / plain:.3f} | {1 / n:.3f} |")
  if args.plot:
    figure, axes = pyplot.subplots(figsize=(5, 3.2))
    counts = [n for n, _, _ in rows]
    axes.plot(counts, [p / 1e6 for _, p, _ in rows], "o-",
              label="unsharded (every replica)")
    axes.plot(counts, [s / 1e6 for _, _, s in rows], "o-",
              label="--shard_optimizer")
    axes.set_xscale("log", base=2)
    axes.set_xticks(counts, [str(n) for n in counts])
    axes.set_xlabel("replicas N")
    axes.set_ylabel("optimizer state per replica, MB")
    axes.set_title(f"{args.model}, {args.optimizer}: measured")
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
  main()
