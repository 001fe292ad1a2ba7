"""tfdist.FileData against a hand-written tf.data loop, over the same files
and parse: the input alone, and a whole training run.

python -m tools.bench_file_rate [--rounds=7] [--dir=/tmp/tfdist-bench-rate]

It writes (once, kept in --dir) two sets of 8 TFRecord files of 64x64x3
images (tools.bench_files' records and parse):
- even:   8 files of the same size;
- uneven: 7 files of one size and one 4 times as large.
Each round, for each set, side by side and in alternating order:
- input: images/s of tfdist's train input alone (one host, --cache=off),
  then of the hand-written loop (interleaved reads, a 10,000-record
  shuffle, parallel parse, batch, prefetch), each in a process of its own,
  after 20 batches that fill the buffers;
- train: steps/s of `python -m tfdist.train --cache=off` against the
  hand-written loop feeding tools.baseline's step (the same model, SGD,
  batch and steps per call), timed between progress lines as
  tools.bench_cli does.
Prints every round, then the median [min-max] of each ratio (tfdist over
hand-written: above 1 is faster).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from . import bench_cli
from . import bench_files

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETS = {"even": [2688] * 8, "uneven": [1536] * 7 + [6144]}
LOOP = 32  # Steps per tf.function call, both contenders.


def _prepare(root, counts):
  import numpy as np
  done = f"{root}/DONE-{'-'.join(map(str, counts))}"  # Sizes changed: anew.
  if not os.path.exists(done):
    os.makedirs(root, exist_ok=True)
    rng = np.random.RandomState(len(counts))
    for number, count in enumerate(counts):
      bench_files.write_records(f"{root}/train-{number:05d}", count, rng)
    bench_files.write_records(f"{root}/eval-00000", 256, rng)
    open(done, "w").close()
  bench_files._warm(root)  # pylint: disable=protected-access


def _input_rate(which, root, batches):
  make = (bench_files.tfdist_pipeline if which == "tfdist"
          else bench_files.hand_pipeline)
  return bench_files.input_rate(make(root), batches)


def _hand_train(root, steps):
  """The hand-written training loop, printing progress as tfdist does."""
  import tensorflow as tf
  import keras
  from . import baseline
  strategy = tf.distribute.get_strategy()
  model = bench_files.build()
  optimizer = keras.optimizers.SGD(0.01)
  iterator = iter(bench_files.hand_pipeline(root))
  loop = baseline.loop_function(strategy, model, optimizer,
                                bench_files.BATCH)
  for done in range(LOOP, steps + 1, LOOP):
    loop(iterator, tf.constant(LOOP))
    print(f"train step {done}/{steps}", flush=True)


def _measure(args):
  """One contender, in this process (fresh for each)."""
  which, root = args.measure.split(":", 1)
  if which == "hand_train":
    _hand_train(root, args.train_steps)
  else:
    print(_input_rate(which, root, args.input_batches))


def _self(*flags):
  out = subprocess.run([sys.executable, "-m", "tools.bench_file_rate",
                        *flags], cwd=_ROOT, check=True, capture_output=True,
                       text=True).stdout
  return float(out.split()[-1])


def _train_rates(root, steps, work, order):
  tfdist_argv = [
      sys.executable, "-m", "tfdist.train", "--model=tools.bench_files:build",
      "--dataset=tools.bench_files:data", f"--batch_size={bench_files.BATCH}",
      f"--train_steps={steps}", f"--steps_per_loop={LOOP}",
      f"--log_every={LOOP}", "--eval_every=0", "--export=false",
      "--checkpoint_every=0", "--cache=off", "--optimizer=sgd",
      f"--model_dir={tempfile.mkdtemp(dir=work)}"]
  hand_argv = [sys.executable, "-m", "tools.bench_file_rate",
               f"--measure=hand_train:{root}", f"--train_steps={steps}"]
  env = {"BENCH_FILES": root}
  argvs = {"tfdist": tfdist_argv, "hand": hand_argv}
  return {name: bench_cli.steps_per_second(argvs[name], env)
          for name in order}


def _round(number, args, work):
  figures = {}
  for name, counts in SETS.items():
    root = f"{args.dir}/{name}"
    order = ("tfdist", "hand") if number % 2 else ("hand", "tfdist")
    rates = {which: _self(f"--measure={which}:{root}",
                          f"--input_batches={args.input_batches}")
             for which in order}
    figures[f"{name}_input"] = rates["tfdist"] / rates["hand"]
    figures[f"{name}_hand_img_s"] = rates["hand"]
    train = _train_rates(root, args.train_steps, work, order)
    figures[f"{name}_train"] = train["tfdist"] / train["hand"]
    figures[f"{name}_hand_steps_s"] = train["hand"]
  return figures


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--dir", default="/tmp/tfdist-bench-rate")
  parser.add_argument("--input_batches", type=int, default=100)
  parser.add_argument("--train_steps", type=int, default=8 * LOOP)
  parser.add_argument("--measure", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.measure:
    _measure(args)
    return
  for name, counts in SETS.items():
    _prepare(f"{args.dir}/{name}", counts)
  rounds = []
  with tempfile.TemporaryDirectory(prefix="tfdist-bench-rate-") as work:
    for number in range(args.rounds):
      rounds.append(_round(number, args, work))
      print(f"round {number + 1}: " + ", ".join(
          f"{k}={v:.3f}" for k, v in rounds[-1].items()), flush=True)
  print("median [min-max] over", args.rounds, "rounds:")
  for key in rounds[0]:
    values = [r[key] for r in rounds]
    print(f"  {key:22s} {statistics.median(values):.3f} "
          f"[{min(values):.3f}-{max(values):.3f}]")


if __name__ == "__main__":
  main()
