"""In-process benchmark helpers: throw-away configs, a tfdist contender, and
interleaved timing. No flags here, so every benchmark tool can import it."""

import statistics
import tempfile
import time


_SCRATCH = []  # Removed when the process exits.


def bench_config(**overrides):
  from tfdist import config as config_lib
  _SCRATCH.append(tempfile.TemporaryDirectory(prefix="tfdist-bench-"))
  base = dict(model_dir=_SCRATCH[-1].name,
              strategy="default", dataset="synthetic", train_steps=10**9,
              eval_every=0, checkpoint_every=0, log_every=10**9, export=False,
              optimizer="adam", learning_rate=1e-3)
  return config_lib.Config(**{**base, **overrides})


def start(config):
  """Starts TensorFlow for in-process benchmarks; returns the StrategyInfo."""
  from tfdist import api
  return api.start_tensorflow(config, api.Role.TRAINER)


def build_trainer(config, info):
  from tfdist import api
  from tfdist import builder
  with api.process_settings(config):
    return builder.build_trainer(config, info,
                                 builder.resolve_task(config, info),
                                 write_dir=config.model_dir)


def train_steps_of(trainer):
  """A contender: `run(steps)` trains that many more steps."""
  def run(steps):
    trainer.train(trainer.step + steps)
  return run


def tfdist_contender(config, info):
  return train_steps_of(build_trainer(config, info))


def measure(contenders, steps, rounds):
  """Steps/sec of each contender in every one of `rounds` interleaved
  rounds: {name: [rate per round]}."""
  for run in contenders.values():
    run(steps)  # Warm-up: tracing and first-call costs.
  rates = {name: [] for name in contenders}
  for _ in range(rounds):
    for name, run in contenders.items():
      start_time = time.perf_counter()
      run(steps)
      rates[name].append(steps / (time.perf_counter() - start_time))
  return rates


def spread(values, fmt="{:.0f}"):
  """'median [min-max]' of a list of numbers."""
  return (fmt.format(statistics.median(values)) + " [" +
          fmt.format(min(values)) + "-" + fmt.format(max(values)) + "]")
