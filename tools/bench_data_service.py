"""Input-bound training with and without the tf.data service.

python -m tools.bench_data_service [--rounds=3] [--steps=60]
    [--dir=/tmp/tfdist-bench-service] [--data=files,own_files,own_range]

It writes (once, kept in --dir) 8 TFRecord files of JPEGs (256x256), whose
parse is CPU-heavy: decode, random crop, resize to 64x64, flip and
colour jitter. The model is a small conv net whose step costs about
what its batch's parse does on one core, so moving the parse away can at
most double the trainer's rate. Each round runs, side by side and in turn:

- local, 1 core:   the trainer (`taskset -c 0`) parses its own input;
- service, 1 + 1:  the same trainer on core 0 with --data_service, one
                   data worker and the dispatcher pinned to core 1;
- local, 2 cores:  the trainer parses its own input on both cores.

For each --data: the files as a tfdist.FileData (files), the same files
and parse as a pipeline built by hand (own_files), and a CPU-heavy map
of a Dataset.range (own_range).

A figure is the trainer's steps/s from step --warmup to --steps (the
moments its log lines appear); each round starts with the next row.
Prints every round, then the median [min-max] of each and of the
service's ratio to the local, 1-core run.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import portpicker

SIDE, OUT, CLASSES, FILES, PER_FILE = 256, 64, 10, 8, 400
BATCH = 64
SHUFFLE = 256
SYNTH = 100  # The synthesized images' side: about the JPEG parse's cost.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STEP = re.compile(r"train step (\d+)/")


# The user's module: --dataset=tools.bench_data_service:data, --model=...

def parse(record):
  """JPEG decode, random crop, resize, flip and colour jitter; uint8 out,
  so a served batch is a quarter of its float size."""
  import tensorflow as tf
  example = tf.io.parse_single_example(record, {
      "jpeg": tf.io.FixedLenFeature([], tf.string),
      "label": tf.io.FixedLenFeature([], tf.int64)})
  image = tf.io.decode_jpeg(example["jpeg"], channels=3)
  image = tf.image.random_crop(image, [SIDE - 32, SIDE - 32, 3])
  image = tf.image.resize(image, [OUT, OUT], method="bicubic")
  image = tf.image.random_flip_left_right(image)
  image = tf.image.random_brightness(image, 0.2 * 255)
  image = tf.image.random_contrast(image, 0.8, 1.2)
  image = tf.image.random_saturation(image, 0.8, 1.2)
  return tf.cast(tf.clip_by_value(image, 0, 255), tf.uint8), example["label"]


def data():
  import tfdist
  root = os.environ["BENCH_SERVICE_FILES"]
  return tfdist.FileData(train=f"{root}/train-*", eval=f"{root}/eval-*",
                         parse=parse, num_classes=CLASSES)


def own_files():
  """The same files and parse, as a pipeline built by hand."""
  import tensorflow as tf
  root = os.environ["BENCH_SERVICE_FILES"]
  return tuple(tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(
      f"{root}/{split}-*"))).map(parse) for split in ("train", "eval"))


def _synthesized(index):
  """An image made from its index (smooth shapes and noise), then the
  crop, resize and jitter of parse(): a CPU-heavy map of a range."""
  import tensorflow as tf
  seed = tf.stack([index, tf.constant(7, tf.int64)])
  low = tf.random.stateless_uniform([16, 16, 3], seed, 0, 255)
  image = tf.image.resize(low[None], [SYNTH, SYNTH])[0]
  image += tf.random.stateless_normal([SYNTH, SYNTH, 3], seed, 0, 12)
  image = tf.image.random_crop(image, [SYNTH - 12, SYNTH - 12, 3])
  image = tf.image.resize(image, [OUT, OUT], method="bicubic")
  image = tf.image.random_flip_left_right(image)
  image = tf.image.random_brightness(image, 0.2 * 255)
  image = tf.image.random_contrast(image, 0.8, 1.2)
  return (tf.cast(tf.clip_by_value(image, 0, 255), tf.uint8),
          index % CLASSES)


def own_range():
  """Dataset.range(n).map(heavy): a pipeline of your own, no files."""
  import tensorflow as tf
  # More examples than a run takes: nothing is read twice, so a cache
  # (tfdist caches a pipeline it does not know reads files) saves nothing.
  return (tf.data.Dataset.range(100_000).map(_synthesized),
          tf.data.Dataset.range(64).map(_synthesized))


def build():
  import keras
  model = keras.Sequential([
      keras.Input((OUT, OUT, 3), dtype="uint8"),
      keras.layers.Rescaling(1 / 255),
      keras.layers.Conv2D(16, 3, activation="relu"),
      keras.layers.MaxPooling2D(2),
      keras.layers.Conv2D(32, 3, activation="relu"),
      keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(CLASSES)])
  model.compile(optimizer="sgd",
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def _write(root):
  import numpy as np
  import tensorflow as tf
  rng = np.random.RandomState(0)
  os.makedirs(root, exist_ok=True)
  for name, files, count in (("train", FILES, PER_FILE), ("eval", 1, 64)):
    for f in range(files):
      with tf.io.TFRecordWriter(f"{root}/{name}-{f:05d}") as out:
        for _ in range(count):
          # Smooth shapes plus noise: photo-like JPEG sizes.
          low = rng.randint(0, 256, (16, 16, 3)).astype(np.float32)
          image = tf.image.resize(low[None], [SIDE, SIDE])[0].numpy()
          image += rng.normal(0, 12, image.shape)
          jpeg = tf.io.encode_jpeg(np.clip(image, 0, 255).astype(np.uint8),
                                   quality=90).numpy()
          out.write(tf.train.Example(features=tf.train.Features(feature={
              "jpeg": tf.train.Feature(bytes_list=tf.train.BytesList(
                  value=[jpeg])),
              "label": tf.train.Feature(int64_list=tf.train.Int64List(
                  value=[int(rng.randint(CLASSES))]))})).SerializeToString())
  with open(f"{root}/DONE", "w") as done:
    done.write("ok")


DATA = {"files": "FileData over the JPEG files",
        "own_files": "TFRecordDataset(files).map(parse), by hand",
        "own_range": "Dataset.range(n).map(heavy), by hand"}


def _trainer(cores, root, model_dir, steps, warmup, extra=(), data="files"):
  """Steps/s of one `python -m tfdist.train` on `cores` (taskset)."""
  function = "data" if data == "files" else data
  command = ["taskset", "-c", cores, sys.executable, "-m", "tfdist.train",
             "--model=tools.bench_data_service:build",
             f"--dataset=tools.bench_data_service:{function}",
             f"--batch_size={BATCH}", f"--train_steps={steps}",
             "--steps_per_loop=1", "--log_every=1", "--eval_every=0",
             "--export=false", "--checkpoint_every=0", "--cache=off",
             # A buffer of a whole epoch would parse it before step 0,
             # out of the measured steps (a pipeline built by hand).
             f"--shuffle_buffer={SHUFFLE}",
             f"--model_dir={model_dir}", *extra]
  proc = subprocess.Popen(command, cwd=_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "BENCH_SERVICE_FILES": root})
  seen = {}
  for line in proc.stdout:
    found = _STEP.search(line)
    if found:
      seen[int(found.group(1))] = time.monotonic()
  if proc.wait() != 0 or warmup not in seen or steps not in seen:
    raise SystemExit(f"the trainer failed: {' '.join(command)}")
  return (steps - warmup) / (seen[steps] - seen[warmup])


def _service(journal):
  """A dispatcher (its journal in a fresh directory: an old one would
  bring back old jobs) and one data worker, pinned to core 1: (address,
  processes)."""
  port = portpicker.pick_unused_port()
  base = ["taskset", "-c", "1", sys.executable, "-m", "launch.data_service"]
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
  dispatcher = subprocess.Popen(
      [*base, "dispatcher", f"--port={port}", f"--work_dir={journal}"],
      cwd=_ROOT, env=env, stdout=subprocess.DEVNULL)
  worker = subprocess.Popen([*base, "worker", f"--dispatcher=127.0.0.1:{port}"],
                            cwd=_ROOT, env=env, stdout=subprocess.DEVNULL)
  return f"grpc://127.0.0.1:{port}", (dispatcher, worker)


def _spread(values):
  return (f"{statistics.median(values):.2f} "
          f"[{min(values):.2f}-{max(values):.2f}]")


def main():
  parser = argparse.ArgumentParser(prog="python -m tools.bench_data_service")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--warmup", type=int, default=10)
  parser.add_argument("--dir", default="/tmp/tfdist-bench-service")
  parser.add_argument("--data", default=",".join(DATA),
                      help=f"comma-separated, of: {', '.join(DATA)}")
  args = parser.parse_args()
  kinds = args.data.split(",")
  if not set(kinds) <= set(DATA):
    parser.error(f"--data takes {', '.join(DATA)}. Received: {args.data}")
  root = os.path.join(args.dir, "files")
  if not os.path.exists(f"{root}/DONE"):
    _write(root)
  journal = tempfile.mkdtemp(prefix="tfdist-bench-dispatcher-")
  address, service = _service(journal)
  runs = {f"{kind}: {name}": (cores, extra, kind) for kind in kinds
          for name, (cores, extra) in (
              ("local, 1 core", ("0", ())),
              ("service, 1 + 1 cores", ("0", (f"--data_service={address}",))),
              ("local, 2 cores", ("0,1", ())))}
  rows = {name: [] for name in runs}
  try:
    for number in range(args.rounds):
      # Each round starts with the next row, so no row always runs first.
      shift = number % len(runs)
      names = list(runs)[shift:] + list(runs)[:shift]
      figures = {}
      for name in names:
        cores, extra, kind = runs[name]
        figures[name] = _trainer(cores, root, f"{args.dir}/run-"
                                 f"{time.time()}", args.steps, args.warmup,
                                 extra, kind)
        rows[name].append(figures[name])
      print(f"round {number + 1}: " + ", ".join(
          f"{n} {v:.2f} steps/s" for n, v in figures.items()), flush=True)
  finally:
    for process in service:
      process.kill()
    shutil.rmtree(journal, ignore_errors=True)
  print(f"\nmedian [min-max] over {args.rounds} rounds, batch {BATCH}:")
  for name, values in rows.items():
    print(f"  {name:36s} {_spread(values)} steps/s")
  for kind in kinds:
    ratio = [s / l for s, l in zip(rows[f"{kind}: service, 1 + 1 cores"],
                                   rows[f"{kind}: local, 1 core"])]
    print(f"  {kind}: service / local 1 core {_spread(ratio)}  "
          f"({DATA[kind]})")


if __name__ == "__main__":
  main()
