"""tfdist.FileData at real size: memory, start-up, resume, bytes per worker
and input throughput, over TFRecords of 64x64x3 images.

python -m tools.bench_files [--rounds=3] [--dir=/tmp/tfdist-bench-files]

It writes (once, kept in --dir) two sets of 8 files: `big` (--big_mb, 1 GB
by default) and `small` (a tenth of it), then, in each round and side by
side, with the files in the page cache:
- memory:   peak RSS (wait4) of `python -m tfdist.train` over one pass of
            each set (train steps = one epoch);
- start-up: from process start to the first train step line, each set;
- resume:   the same, for a run resuming at 90% of an epoch of `big`
            (its checkpoint written before the round), against a fresh
            start over `big`;
- bytes:    /proc/PID/io rchar of each of 2 MultiWorkerMirrored workers
            (launch.local --isolate=off) per epoch of `big`, over epochs
            2 to 5, as a share of the train files' bytes;
- input:    images/s of tfdist's train input alone (one host) against a
            hand-written tf.data loop over the same files and parse
            (interleaved reads, a 10,000-record shuffle, parallel parse,
            batch, prefetch), in this process.
Prints every round, then the median [min-max] of each figure.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

SIDE, CLASSES, FILES = 64, 10, 8
IMAGE_BYTES = SIDE * SIDE * 3
BATCH = 256
EPOCHS_READ = 4  # Epochs a worker's bytes are averaged over.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STEP = re.compile(r"train step (\d+)/")
# A task launch.local started: its name and pid.
STARTED = re.compile(r"^\[launch\] started (worker:\d) pid=(\d+)")


# The user's module: --dataset=tools.bench_files:data, --model=...:build.

def parse(record):
  import tensorflow as tf
  example = tf.io.parse_single_example(record, {
      "image": tf.io.FixedLenFeature([], tf.string),
      "label": tf.io.FixedLenFeature([], tf.int64)})
  image = tf.reshape(tf.io.decode_raw(example["image"], tf.uint8),
                     [SIDE, SIDE, 3])
  return tf.cast(image, tf.float32) / 255.0, example["label"]


def data():
  import tfdist
  root = os.environ["BENCH_FILES"]
  return tfdist.FileData(train=f"{root}/train-*", eval=f"{root}/eval-*",
                         parse=parse, num_classes=CLASSES)


def build():
  import keras
  model = keras.Sequential([
      keras.Input((SIDE, SIDE, 3)),
      keras.layers.AveragePooling2D(8), keras.layers.Flatten(),
      keras.layers.Dense(CLASSES)])
  model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  return model


# Writing the files.

def write_records(path, count, rng):
  """`count` random images and labels in one TFRecord file."""
  import numpy as np
  import tensorflow as tf
  with tf.io.TFRecordWriter(path) as out:
    for _ in range(count):
      image = rng.randint(0, 256, IMAGE_BYTES, dtype=np.uint8)
      out.write(tf.train.Example(features=tf.train.Features(feature={
          "image": tf.train.Feature(bytes_list=tf.train.BytesList(
              value=[image.tobytes()])),
          "label": tf.train.Feature(int64_list=tf.train.Int64List(
              value=[int(image[0]) % CLASSES]))})).SerializeToString())


def _write_set(root, total_bytes):
  import numpy as np
  per_file = max(1, total_bytes // IMAGE_BYTES // FILES)
  rng = np.random.RandomState(0)
  os.makedirs(root, exist_ok=True)
  for name, count, files in (("train", per_file, FILES),
                             ("eval", min(per_file, 512), 1)):
    for f in range(files):
      write_records(f"{root}/{name}-{f:05d}", count, rng)
  with open(f"{root}/DONE", "w") as done:
    done.write(str(per_file))


def _prepare(root, total_bytes):
  if not os.path.exists(f"{root}/DONE"):
    start = time.perf_counter()
    _write_set(root, total_bytes)
    print(f"wrote {root}: {total_bytes / 2**20:.0f} MiB in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
  with open(f"{root}/DONE") as done:
    return int(done.read()) * FILES  # Train examples.


def _warm(root):
  for name in os.listdir(root):
    with open(os.path.join(root, name), "rb") as stream:
      while stream.read(1 << 24):
        pass


# Measurements.

def _train_args(model_dir, steps, extra=()):
  return ["--model=tools.bench_files:build", "--dataset=tools.bench_files:data",
          f"--batch_size={BATCH}", f"--train_steps={steps}",
          "--steps_per_loop=1", "--log_every=1", "--eval_every=0",
          "--export=false", "--checkpoint_every=0", f"--model_dir={model_dir}",
          *extra]


def _cli(root, model_dir, steps):
  """(seconds from start to the first step line, peak RSS MiB)."""
  start = time.monotonic()
  first = None
  proc = subprocess.Popen(
      [sys.executable, "-m", "tfdist.train", *_train_args(model_dir, steps)],
      cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "BENCH_FILES": root, "PYTHONUNBUFFERED": "1"})
  tail = []
  for line in proc.stdout:
    tail = (tail + [line])[-20:]
    if first is None and _STEP.search(line):
      first = time.monotonic() - start
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode or first is None:
    raise RuntimeError("tfdist.train failed:\n" + "".join(tail))
  return first, usage.ru_maxrss / 1024


def _rchar(pid):
  try:
    with open(f"/proc/{pid}/io") as io:
      return int(dict(line.split(": ") for line in io.read().splitlines())
                 ["rchar"])
  except (OSError, ValueError):
    return None


def _worker_bytes(root, model_dir, epoch):
  """Bytes each of two workers reads per epoch of training: rchar between
  the chief's step lines at the ends of epochs 1 and 1 + EPOCHS_READ, over
  EPOCHS_READ. A worker reads ahead by up to a shuffle window (0.12 of the
  bytes here), and by a different amount at each step: measured between
  two steps one epoch apart, the share came out anywhere from 0.34 to 0.61
  while the in-process count at the ends of epochs was 0.50."""
  marks = (epoch, (1 + EPOCHS_READ) * epoch)
  proc = subprocess.Popen(
      [sys.executable, "-m", "tfdist.launch.local", "--workers=2",
       "--isolate=off", "--", *_train_args(
           model_dir, marks[1] + 5, ["--strategy=multi_worker_mirrored"])],
      cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "BENCH_FILES": root, "PYTHONUNBUFFERED": "1"})
  pids, seen, tail = {}, [], []
  for line in proc.stdout:
    tail = (tail + [line])[-20:]
    found = STARTED.match(line)
    if found:
      pids[found.group(1)] = int(found.group(2))
    step = _STEP.search(line)
    if (step and line.startswith("worker:0") and len(seen) < 2
        and int(step.group(1)) >= marks[len(seen)]):
      seen.append([_rchar(pids[name]) for name in sorted(pids)])
  if proc.wait() or len(seen) < 2:
    raise RuntimeError("launch.local failed:\n" + "".join(tail))
  return [(b - a) / EPOCHS_READ for a, b in zip(*seen)]


def _input_rates(root, batches):
  """(tfdist images/s, hand-written images/s) over `batches` batches, in a
  process of its own (a child forked from a process holding TF's memory
  would carry that peak RSS into the next measurement)."""
  out = subprocess.run(
      [sys.executable, "-m", "tools.bench_files", f"--input_only={root}",
       f"--input_batches={batches}"], cwd=_ROOT, check=True,
      capture_output=True, text=True).stdout.split()
  return float(out[-2]), float(out[-1])


def hand_pipeline(root):
  """The loop a TF engineer writes over these files: interleaved reads, a
  10,000-record shuffle, parallel parse, batch, prefetch."""
  import tensorflow as tf
  return tf.data.TFRecordDataset(
      sorted(tf.io.gfile.glob(f"{root}/train-*")),
      num_parallel_reads=tf.data.AUTOTUNE).repeat().shuffle(10_000).map(
          parse, num_parallel_calls=tf.data.AUTOTUNE).batch(
              BATCH, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def tfdist_pipeline(root):
  """tfdist's train input over the files, one host, nothing cached."""
  import tensorflow as tf
  from tfdist import data as data_lib
  os.environ["BENCH_FILES"] = root
  dataset = data_lib.file_dataset(data(), "bench")
  return data_lib.train_input_fn(
      dataset, global_batch_size=BATCH, seed=1, cache="off")(
          tf.distribute.InputContext())


def input_rate(pipeline, batches):
  """Images/s of `pipeline` over `batches` batches, after 20 that fill
  its buffers and start its threads."""
  iterator = iter(pipeline)
  for _ in range(20):
    next(iterator)
  start = time.perf_counter()
  for _ in range(batches):
    next(iterator)
  return batches * BATCH / (time.perf_counter() - start)


def _measure_input(root, batches):
  return [input_rate(make(root), batches)
          for make in (tfdist_pipeline, hand_pipeline)]


def _spread(values, unit=""):
  return (f"{statistics.median(values):.2f}{unit} "
          f"[{min(values):.2f}-{max(values):.2f}]")


def _round(big, small, sizes, work):
  epoch_big, epoch_small = (sizes[0] // BATCH, sizes[1] // BATCH)
  resume_at = int(0.9 * epoch_big)
  figures = {}
  start_big, rss_big = _cli(big, f"{work}/big-{time.time()}", epoch_big)
  start_small, rss_small = _cli(small, f"{work}/small-{time.time()}",
                                epoch_small)
  # The resume: a copy of the 90% checkpoint, so each round resumes anew.
  resumed = f"{work}/resume-{time.time()}"
  subprocess.run(["cp", "-r", f"{work}/at90", resumed], check=True)
  start_resume, _ = _cli(big, resumed, resume_at + 5)
  figures["rss_big_mb"], figures["rss_small_mb"] = rss_big, rss_small
  figures["rss_diff_mb"] = rss_big - rss_small
  figures["start_diff_s"] = start_big - start_small
  figures["resume_diff_s"] = start_resume - start_big
  read = _worker_bytes(big, f"{work}/mwms-{time.time()}", epoch_big)
  train_bytes = sum(os.path.getsize(os.path.join(big, n))
                    for n in os.listdir(big) if n.startswith("train-"))
  figures["worker0_share"], figures["worker1_share"] = (
      r / train_bytes for r in read)
  return figures


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--big_mb", type=int, default=1024)
  parser.add_argument("--dir", default="/tmp/tfdist-bench-files")
  parser.add_argument("--input_batches", type=int, default=150)
  parser.add_argument("--input_only", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.input_only:
    print(*_measure_input(args.input_only, args.input_batches))
    return
  big, small = f"{args.dir}/big", f"{args.dir}/small"
  sizes = (_prepare(big, args.big_mb << 20),
           _prepare(small, (args.big_mb << 20) // 10))
  _warm(big), _warm(small)
  work = tempfile.mkdtemp(prefix="tfdist-bench-files-")
  at90 = int(0.9 * (sizes[0] // BATCH))
  _cli(big, f"{work}/at90", at90)
  print(f"big: {sizes[0]} images, small: {sizes[1]}; the resume starts at "
        f"step {at90} of {sizes[0] // BATCH}", flush=True)
  rounds = []
  for number in range(args.rounds):
    figures = _round(big, small, sizes, work)
    tfdist_rate, hand_rate = _input_rates(big, args.input_batches)
    figures["input_ratio"] = tfdist_rate / hand_rate
    figures["tfdist_images_s"], figures["hand_images_s"] = (tfdist_rate,
                                                            hand_rate)
    rounds.append(figures)
    print(f"round {number + 1}: " + ", ".join(
        f"{k}={v:.2f}" for k, v in figures.items()), flush=True)
  print("median [min-max] over", args.rounds, "rounds:")
  for key in rounds[0]:
    print(f"  {key:16s} {_spread([r[key] for r in rounds])}")
  subprocess.run(["rm", "-rf", work], check=False)


if __name__ == "__main__":
  main()
