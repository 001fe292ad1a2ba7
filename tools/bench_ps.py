"""Async parameter-server throughput against MultiWorkerMirrored.

python -m tools.bench_ps [--short=500] [--long=1500] [--rounds=2]

Same model, data, global batch and steps per call for every contender; each
rate comes from two run lengths (start-up cancels), median over rounds, all
in one run of this tool. On a 2-core machine every process shares the same
two cores, so this measures the frameworks' overhead, not scaling.
"""

import os
import statistics

from absl import app
from absl import flags

from . import jobs

FLAGS = flags.FLAGS
flags.DEFINE_integer("short", 500, "Steps of the short run.")
flags.DEFINE_integer("long", 1500, "Steps of the long run.")
flags.DEFINE_integer("rounds", 2, "Rounds; medians are reported.")
flags.DEFINE_string("model", "mlp", "Model from the zoo.")
flags.DEFINE_integer("batch_size", 64, "Global batch per step.")
flags.DEFINE_string("data_dir", "~/tensorflow_datasets", "tfds data_dir.")

CONTENDERS = {
    "async PS, 1 worker (+chief, 1 ps)": (
        ["--chief", "--workers=1", "--ps=1"], "parameter_server"),
    "async PS, 2 workers (+chief, 1 ps)": (
        ["--chief", "--workers=2", "--ps=1"], "parameter_server"),
    "MWMS, 2 workers": (["--workers=2"], "multi_worker_mirrored"),
}


def main(argv):
  del argv
  rates = {name: [] for name in CONTENDERS}
  for _ in range(FLAGS.rounds):
    for name, (launcher_args, strategy) in CONTENDERS.items():
      train_args = [f"--strategy={strategy}", f"--model={FLAGS.model}",
                    "--dataset=digits", f"--data_dir={FLAGS.data_dir}",
                    f"--batch_size={FLAGS.batch_size}",
                    "--steps_per_loop=50"]
      rates[name].append(jobs.steps_per_second(
          launcher_args, train_args, short=FLAGS.short, long=FLAGS.long))
  reference = statistics.median(rates["MWMS, 2 workers"])
  print(f"model {FLAGS.model}, batch {FLAGS.batch_size} per step, "
        f"{FLAGS.rounds} rounds, {os.cpu_count()} CPUs")
  print("| contender | steps/s | / MWMS 2 workers |")
  print("|---|---:|---:|")
  for name, values in rates.items():
    rate = statistics.median(values)
    print(f"| {name} | {rate:.0f} | {rate / reference:.2f} |")


if __name__ == "__main__":
  app.run(main)
