"""What the outer loop says as it trains: the running metrics of a log
interval (examples/s, the time a step waited for input) and its line."""

import datetime
import math
import time

from absl import logging


class Meter:
  """Running train metrics between two log lines."""

  def __init__(self, now, global_batch_size, metrics):
    self._global_batch_size = global_batch_size
    self._metrics = metrics
    self.reset(now)

  def reset(self, now):
    self.start, self.sums = now, None

  def add(self, sums):
    self.sums = sums if self.sums is None else self.sums.add(sums)

  def read(self, now):
    seconds = max(now - self.start, 1e-9)
    steps = self.sums.steps if self.sums else 0
    values = {"loss": self.sums.loss_sum / max(steps, 1) if steps else 0.0}
    if self.sums:
      values.update(self._metrics.results(self.sums.metric_states))
    values["steps_per_sec"] = steps / seconds
    values["examples_per_sec"] = steps * self._global_batch_size / seconds
    # Milliseconds a step waited for its batch: input-bound when it is a
    # large share of 1000 / steps_per_sec. NaN: not measured (PS).
    if steps and not math.isnan(self.sums.input_wait):
      values["input_wait_ms"] = 1000 * self.sums.input_wait / steps
    return values


def log_line(step, total, metrics, first_step, loop_started):
  """`train step k/N: metrics  examples/s  input wait  ETA`."""
  elapsed = time.perf_counter() - loop_started
  rate = (step - first_step) / max(elapsed, 1e-9)
  eta = datetime.timedelta(seconds=round((total - step) / max(rate, 1e-9)))
  shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                    if k not in ("steps_per_sec", "examples_per_sec",
                                 "input_wait_ms"))
  wait = metrics.get("input_wait_ms")
  waited = "" if wait is None else f"  input wait {wait:.1f} ms/step"
  logging.info("train step %d/%d: %s  %.0f examples/s%s  ETA %s", step,
               total, shown, metrics["examples_per_sec"], waited, eta)
