"""Model parallelism on logical CPUs: step time, bytes per device, bubble.

python -m tools.bench_model_parallel [--rounds=3] [--steps=20]

One process with 4 logical CPUs; every configuration trains the same wide
MLP (1024-2048-2048-10) on synthetic data with the same global batch,
interleaved round by round; medians are printed.

Bubble: GPipe's idle fraction is (K-1)/(M+K-1) for K stages and M
micro-batches. Logical CPUs share the physical cores, and the unsplit model
already keeps every core busy with intra-op threads, so wall time cannot
isolate the bubble here; the measured column is the time the pipeline adds,
1 - T_unsplit / T_pipeline (bubble plus transfers plus scheduling).
"""

import os
import statistics

from absl import app
from absl import flags

from . import inprocess
from tfdist import devices

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")
flags.DEFINE_integer("steps", 20, "Steps per round.")
flags.DEFINE_integer("batch_size", 256, "Global batch.")
flags.DEFINE_integer("num_microbatches", 4, "Micro-batches for pipelines.")

CONFIGS = {
    "unsplit": {},
    "pipeline, 2 stages": {"model_parallel": "pipeline", "num_stages": 2},
    "pipeline, 4 stages": {"model_parallel": "pipeline", "num_stages": 4},
    "tensor, 2-way": {"model_parallel": "tensor", "tensor_parallel": 2},
    "tensor, 4-way": {"model_parallel": "tensor", "tensor_parallel": 4},
}


def main(argv):
  del argv
  base = dict(model="mlp_wide", synthetic_shape=(32, 32, 1),
              batch_size=FLAGS.batch_size, steps_per_loop=FLAGS.steps,
              num_cpu_devices=4, num_microbatches=FLAGS.num_microbatches)
  info = inprocess.start(inprocess.bench_config(**base))

  runs, device_bytes = {}, {}
  for name, overrides in CONFIGS.items():
    trainer = inprocess.build_trainer(
        inprocess.bench_config(**base, **overrides), info)
    runs[name] = inprocess.train_steps_of(trainer)
    device_bytes[name] = devices.bytes_per_device(
        trainer.model.weights, info.strategy)
  rates = {name: statistics.median(r) for name, r in
           inprocess.measure(runs, FLAGS.steps, FLAGS.rounds).items()}
  cores = os.cpu_count()
  print(f"\nMLP 1024-2048-2048-10, batch {FLAGS.batch_size}, "
        f"{FLAGS.num_microbatches} micro-batches, {FLAGS.rounds} rounds of "
        f"{FLAGS.steps} steps, 4 logical CPUs on {cores} cores, medians:")
  print("| configuration | step ms | MB per device (CPU:0..3) | added time, "
        "1 - T_unsplit/T | bubble, GPipe formula |")
  print("|---|---:|---|---:|---:|")
  for name, overrides in CONFIGS.items():
    step_ms = 1000 / rates[name]
    sizes = " / ".join(f"{device_bytes[name].get(f'CPU:{i}', 0) / 2**20:.1f}"
                       for i in range(4))
    measured = formula = "-"
    if overrides.get("model_parallel") == "pipeline":
      k, m = overrides["num_stages"], FLAGS.num_microbatches
      formula = f"{(k - 1) / (m + k - 1):.2f}"
    if overrides:
      measured = f"{1 - rates[name] / rates['unsplit']:.2f}"
    print(f"| {name} | {step_ms:.1f} | {sizes} | {measured} | {formula} |")


if __name__ == "__main__":
  app.run(main)
