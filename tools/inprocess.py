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


def train_steps_of(trainer):
  """A contender: `run(steps)` trains that many more steps."""
  def run(steps):
    trainer.train(trainer.step + steps)
  return run


def tfdist_contender(config, info, dataset):
  from tfdist import trainer as trainer_lib
  return train_steps_of(trainer_lib.Trainer(config=config, strategy_info=info,
                                            dataset=dataset))


def measure(contenders, steps, rounds):
  """Median steps/sec of each contender over interleaved rounds."""
  for run in contenders.values():
    run(steps)  # Warm-up: tracing and first-call costs.
  rates = {name: [] for name in contenders}
  for _ in range(rounds):
    for name, run in contenders.items():
      start = time.perf_counter()
      run(steps)
      rates[name].append(steps / (time.perf_counter() - start))
  return {name: statistics.median(r) for name, r in rates.items()}
