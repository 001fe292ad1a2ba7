"""Where a replica's memory goes: peak RSS of each process of a training
run, against the default strategy's, on a model of ~100M parameters.

python -m tools.bench_replica_memory [--rounds=1] [--steps=6]
    [--configs=default,mwms,mwms_shard,mwms_gradients,mwms_params]
    [--workers=2[,4,...]] [--timeline] [--plot=docs/shard_params_memory.png]
    [--resume]

A user's 12-layer MLP (`mlp_100m`: 64 x 2,900, then 11 x 2,900 x 2,900,
then 2,900 x 10 float32 weights, 92.8M parameters; with Adam 1.1 GB of
training state) trains `--steps` steps at batch 8 on
digits, in a fresh model_dir, as:
- default: `python -m tfdist.train --strategy=default`, one process;
- mwms: 2 MultiWorkerMirrored workers (`python -m launch.local
  --workers=2 --isolate=off`);
- mwms_shard: the same with --shard_optimizer;
- mwms_gradients: the same with --shard=gradients;
- mwms_params: the same with --shard=params.
`--workers`: the MWMS configs' worker counts (2); `--plot`: a PNG of
each config's growth against N, the default strategy at N=1.
Each is run again with a tiny model (`mlp_tiny`), and the growth is the
difference of peak RSS (VmHWM, read from /proc every 0.1 s while the
process lives): what the model costs, not TensorFlow's own start-up.
Prints each process's growth and its ratio to the default strategy's.
`--resume`: each run first trains `--steps` unmeasured, and what is
measured is a second run in the same model_dir that restores its
checkpoint and trains `--steps` more.
`--timeline`: also prints the RSS of the process that peaked highest at
each line of the run's output (where the memory is taken).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from . import bench_files
from . import plotting

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH, DEPTH = 2900, 12


def mlp(width, name):
  """DEPTH dense layers of `width` units on 8x8 digits, then 10 logits."""
  import keras
  return keras.Sequential(
      [keras.Input((8, 8, 1)), keras.layers.Flatten()]
      + [keras.layers.Dense(width, activation="relu") for _ in range(DEPTH)]
      + [keras.layers.Dense(10)], name=name)


def mlp_100m():
  """The user's model: 12 dense layers of 2,900 units (92.8M weights)."""
  return mlp(WIDTH, "mlp_100m")


def mlp_tiny():
  import keras
  return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                           keras.layers.Dense(16, activation="relu"),
                           keras.layers.Dense(10)], name="mlp_tiny")


def status_mb(pid, field):
  """VmHWM or VmRSS of `pid` (or "self") in MB, or None once it is gone."""
  try:
    with open(f"/proc/{pid}/status") as status:
      for line in status:
        if line.startswith(f"{field}:"):
          return int(line.split()[1]) / 1024
  except OSError:
    return None
  return None


class _Watch:
  """Follows the peak RSS of every pid it is told about, and (for the
  first) the RSS at each line of the run's output."""

  def __init__(self):
    self.peaks, self.timeline, self._pids = {}, [], {}
    self._done = False
    self._thread = threading.Thread(target=self._poll, daemon=True)
    self._thread.start()

  def add(self, name, pid):
    self._pids[name] = pid

  def line(self, text):
    rss = {name: status_mb(pid, "VmRSS") for name, pid in self._pids.items()}
    self.timeline.append((rss, text.rstrip()[:100]))

  def _poll(self):
    while not self._done:
      for name, pid in list(self._pids.items()):
        peak = status_mb(pid, "VmHWM")
        if peak is not None:
          self.peaks[name] = max(self.peaks.get(name, 0), peak)
      time.sleep(0.1)

  def stop(self):
    self._done = True
    self._thread.join()


def _command(config, model, model_dir, data_dir, steps, extra_flags=(),
             workers=2):
  train = [f"--model=tools.bench_replica_memory:{model}",
           f"--model_dir={model_dir}", f"--data_dir={data_dir}",
           "--optimizer=adam", "--batch_size=8", f"--train_steps={steps}",
           "--steps_per_loop=1", "--log_every=1", "--eval_every=0",
           "--noexport", "--checkpoint_every=0", *extra_flags]
  if config == "default":
    return [sys.executable, "-m", "tfdist.train", *train,
            "--strategy=default"]
  extra = {"mwms_shard": ["--shard_optimizer"],
           "mwms_gradients": ["--shard=gradients"],
           "mwms_params": ["--shard=params"]}.get(config, [])
  return [sys.executable, "-m", "launch.local", f"--workers={workers}",
          "--isolate=off", "--", *train, "--strategy=multi_worker_mirrored",
          *extra]


def _run(config, model, root, data_dir, steps, extra_flags=(), workers=2,
         resume=False):
  """{process: peak MB}, and the first process's timeline. `resume`:
  what is measured is a second run of `steps` more, from the first's
  checkpoint (not measured)."""
  model_dir = tempfile.mkdtemp(dir=root)
  if resume:
    first = subprocess.run(_command(config, model, model_dir, data_dir,
                                    steps, extra_flags, workers),
                           cwd=_ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    if first.returncode:
      raise RuntimeError(f"{config} {model}'s first run exited "
                         f"{first.returncode}:\n{first.stdout[-4000:]}")
    steps *= 2
  watch = _Watch()
  proc = subprocess.Popen(_command(config, model, model_dir, data_dir, steps,
                                   extra_flags, workers),
                          cwd=_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  if config == "default":
    watch.add("process", proc.pid)
  tail = []
  for line in proc.stdout:
    tail = (tail + [line])[-40:]
    started = bench_files.STARTED.match(line)
    if started:
      watch.add(started.group(1), int(started.group(2)))
    watch.line(line)
  code = proc.wait()
  watch.stop()
  if code:
    raise RuntimeError(f"{config} {model} exited {code}:\n" + "".join(tail))
  return watch.peaks, watch.timeline


def _round(args, root, data_dir):
  """{label: {process: growth MB}}, {label: (timeline, peaks)}; a label
  is the config, with its worker count when several are asked for."""
  growth, timelines = {}, {}
  for workers in args.workers:
    for config in args.configs:
      if config == "default" and workers != args.workers[0]:
        continue  # One process whatever the worker count.
      label = _label(args, config, workers)
      big, timeline = _run(config, "mlp_100m", root, data_dir, args.steps,
                           args.flags, workers, args.resume)
      tiny, _ = _run(config, "mlp_tiny", root, data_dir, args.steps,
                     args.flags, workers, args.resume)
      growth[label] = {name: big[name] - tiny.get(name, 0) for name in big}
      timelines[label] = (timeline, big)
  return growth, timelines


def _label(args, config, workers):
  if config == "default" or len(args.workers) == 1:
    return config
  return f"{config} N={workers}"


def _plot(args, medians, path):
  """Peak growth per process against N, one line per config (the default
  strategy at N=1 on each), as docs/shard_params_memory.png."""
  pyplot = plotting.pyplot()
  figure, axes = pyplot.subplots(figsize=(5, 3.2))
  base = medians.get("default")
  for config in args.configs:
    if config == "default":
      continue
    counts = [n for n in args.workers if _label(args, config, n) in medians]
    values = [medians[_label(args, config, n)] for n in counts]
    if base is not None:
      counts, values = [1] + counts, [base] + values
    axes.plot(counts, values, "o-", label=config)
  if base is not None:
    axes.axhline(base, color="gray", linestyle=":", label="default, N=1")
  axes.set_xlabel("MWMS workers N")
  axes.set_ylabel("peak RSS growth per process (MB)")
  axes.set_xticks([1] + list(args.workers))
  axes.legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  print(f"wrote {path}")


def _print_timeline(config, timeline, peaks):
  """The RSS of the process that peaked highest, at each output line
  where it moved by more than 50 MB."""
  name = max(peaks, key=peaks.get)
  print(f"\n{config}: RSS (MB) of {name} at the output lines")
  last = None
  for rss, text in timeline:
    now = rss.get(name)
    if now is not None and (last is None or abs(now - last) > 50):
      print(f"  {now:8.0f}  {text}")
      last = now


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--configs",
                      default="default,mwms,mwms_shard,mwms_params")
  parser.add_argument("--timeline", action="store_true")
  parser.add_argument("--resume", action="store_true",
                      help="measure a run that resumes from a checkpoint")
  parser.add_argument("--workers", default="2",
                      help="MWMS workers of the mwms* configs: N or N,M,...")
  parser.add_argument("--plot", default="",
                      help="a PNG of growth against N (matplotlib)")
  parser.add_argument("--flags", default="",
                      help="more tfdist.train flags, space-separated")
  args = parser.parse_args()
  args.configs = args.configs.split(",")
  args.flags = args.flags.split()
  args.workers = [int(n) for n in args.workers.split(",")]
  if args.plot:
    plotting.pyplot()  # Before the runs: a missing matplotlib costs none.
  rounds = []
  with tempfile.TemporaryDirectory(prefix="tfdist-bench-memory-") as root:
    data_dir = os.path.join(root, "data")
    subprocess.run([sys.executable, "-c", "import sys; from tfdist import "
                    "digits; digits.prepare(sys.argv[1])", data_dir],
                   cwd=_ROOT, check=True, capture_output=True)
    for number in range(args.rounds):
      growth, timelines = _round(args, root, data_dir)
      rounds.append(growth)
      print(f"round {number + 1}: " + "; ".join(
          f"{c}: " + ", ".join(f"{n} +{mb:.0f} MB" for n, mb in sorted(g.items()))
          for c, g in growth.items()), flush=True)
      if args.timeline:
        for config, (timeline, peaks) in timelines.items():
          _print_timeline(config, timeline, peaks)
  base = statistics.median(r["default"]["process"] for r in rounds) if (
      "default" in args.configs) else None
  print("\nmedian peak RSS growth per process (100M model minus tiny):")
  medians = {}
  for label in rounds[0]:
    worst = [max(r[label].values()) for r in rounds]
    medians[label] = statistics.median(worst)
    ratio = (f" ({medians[label] / base:.2f}x the default strategy)"
             if base else "")
    print(f"  {label:18s} +{medians[label]:.0f} MB [{min(worst):.0f}-"
          f"{max(worst):.0f}]{ratio}")
  if args.plot:
    _plot(args, medians, args.plot)


if __name__ == "__main__":
  main()
