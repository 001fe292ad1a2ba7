"""Bytes on the wire per step for 2-worker MultiWorkerMirrored, measured.

sudo python -m tools.bench_allreduce [--short=200] [--long=600]

Runs the job in a fresh network namespace, so its loopback counter sees only
this job. Each configuration runs twice, for --short and --long steps; the
difference in bytes and seconds, divided by the difference in steps, is the
per-step cost with start-up, eval and export cancelled out. Loopback counts
every packet once, so bytes per worker = total / workers.

Compared with the ring all-reduce lower bound 2(N-1)/N x gradient bytes,
and with raw TensorFlow MWMS on the same model (tools/raw_mwms.py), in the
same run. Needs root (ip netns) and iproute2.
"""

import os
import subprocess

from absl import app
from absl import flags

from . import jobs

FLAGS = flags.FLAGS
flags.DEFINE_integer("short", 200, "Steps of the short run.")
flags.DEFINE_integer("long", 600, "Steps of the long run.")
flags.DEFINE_integer("workers", 2, "Worker processes.")
flags.DEFINE_string("model", "mlp", "Model from the zoo.")
flags.DEFINE_integer("batch_size", 64, "Global batch.")
flags.DEFINE_list("dtypes", ["float32", "float16"], "allreduce_dtype values.")
flags.DEFINE_string("data_dir", "~/tensorflow_datasets", "tfds data_dir.")

class Namespace:
  """A network namespace with only a loopback device, removed on exit."""

  def __init__(self):
    self.name = f"tfdist-bench-{os.getpid()}"

  def __enter__(self):
    subprocess.run(["ip", "netns", "add", self.name], check=True)
    self.run(["ip", "link", "set", "lo", "up"], check=True)
    return self

  def __exit__(self, *exc):
    subprocess.run(["ip", "netns", "del", self.name], check=False)

  def run(self, argv, **kwargs):
    return subprocess.run(["ip", "netns", "exec", self.name, *argv],
                          **kwargs)

  def tx_bytes(self):
    out = self.run(["cat", "/sys/class/net/lo/statistics/tx_bytes"],
                   check=True, capture_output=True, text=True).stdout
    return int(out)


def _gradient_bytes(model, dtype):
  from tfdist import quiet  # pylint: disable=g-import-not-at-top
  with quiet.native_stderr_captured():
    from tfdist import models  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    built = models.build(model, input_shape=(8, 8, 1), num_classes=10)
    built(tf.zeros([1, 8, 8, 1]))  # Create the variables to count them.
  per_value = 2 if dtype in ("float16", "bfloat16") else 4
  return sum(int(w.numpy().size) for w in built.trainable_weights) * per_value


def _train(ns, steps, dtype, module="tfdist.train"):
  before = ns.tx_bytes()
  seconds = jobs.run_job(
      [f"--workers={FLAGS.workers}", f"--module={module}"],
      ["--strategy=multi_worker_mirrored", f"--model={FLAGS.model}",
       "--dataset=digits", f"--data_dir={FLAGS.data_dir}",
       f"--batch_size={FLAGS.batch_size}", "--steps_per_loop=50",
       f"--allreduce_dtype={dtype}", "--all_reduce_alg=ring"],
      steps=steps, prefix=("ip", "netns", "exec", ns.name))
  return ns.tx_bytes() - before, seconds


def main(argv):
  del argv
  n = FLAGS.workers
  print(f"{n} workers, model {FLAGS.model}, batch {FLAGS.batch_size}, "
        f"runs of {FLAGS.short} and {FLAGS.long} steps, loopback in a "
        "fresh network namespace.")
  float32_bound = 2 * (n - 1) / n * _gradient_bytes(FLAGS.model, "float32")
  print("| run, all-reduce dtype | ring bound, bytes/worker/step | measured "
        "bytes/worker/step | measured / bound | measured / float32 bound "
        "| steps/s |")
  print("|---|---:|---:|---:|---:|---:|")
  contenders = [("raw TF MWMS, float32", "float32", "tools.raw_mwms")] + [
      (f"tfdist, {dtype}", dtype, "tfdist.train") for dtype in FLAGS.dtypes]
  with Namespace() as ns:
    for label, dtype, module in contenders:
      runs = {steps: _train(ns, steps, dtype, module)
              for steps in (FLAGS.short, FLAGS.long)}
      extra_steps = FLAGS.long - FLAGS.short
      per_step = (runs[FLAGS.long][0] - runs[FLAGS.short][0]) / extra_steps
      per_worker = per_step / n
      rate = extra_steps / (runs[FLAGS.long][1] - runs[FLAGS.short][1])
      bound = 2 * (n - 1) / n * _gradient_bytes(FLAGS.model, dtype)
      print(f"| {label} | {bound:.0f} | {per_worker:.0f} | "
            f"{per_worker / bound:.3f} | {per_worker / float32_bound:.3f} | "
            f"{rate:.0f} |", flush=True)


if __name__ == "__main__":
  app.run(main)
