"""A scaling model of synchronous data-parallel training, checked against
the network lab, and projected to many workers.

python -m tools.scaling --lab_json=docs/netlab.json [--plots=docs]

Step time on N workers:
  T(N) = T_compute + (1 - phi) * T_allreduce(N)
  T_allreduce(N) = 2(N-1) * alpha * packs + 2(N-1)/N * S / B      (ring)
S: bytes each worker all-reduces per step; packs: collectives per step
(PowerSGD runs two; --bytes_per_pack splits one into several). phi: the
share of the all-reduce hidden behind the backward pass: 0 for the lab
runs checked here (measured before --overlap_allreduce) and for PowerSGD
(it needs every gradient); for the plain all-reduce with overlap, fitted
from an overlap lab run (--overlap_json: tools.netlab with configs C and
C/serial), and used in the projection.

From the lab JSON (tools.netlab --probe_sizes=...):
- alpha and B per link and worker count: a least-squares fit of the
  probe's all-reduce times over sizes (all-reduces run back to back in one
  tf.function, as in training; on a 2-core host the lab's tasks share the
  CPU that moves their packets, so B falls as N grows);
- measured step time: the fastest of the lab's rounds. Interference on a
  shared host (other tasks, packet processing, the launcher) only ever
  adds time, so the fastest round is the best estimate of the step the
  model describes (timeit's rule); the median is shown next to it.
- T_compute per worker count: the lab's PowerSGD run on the fastest link,
  less its modelled all-reduce (that row is the calibration, marked so;
  every other row is a prediction). A one-process run is also shown: on a
  2-core VM it misses the cost two synchronised workers add.
"""

import dataclasses
import json
import math
import os
import statistics
import sys
from typing import Dict, List, Sequence, Tuple

from . import plotting

PHI_TFDIST = 0.0  # The checked lab runs: before overlap.
RATES_BITS = {"100mbit": 1e8, "200mbit": 2e8, "500mbit": 5e8, "1gbit": 1e9,
              "10gbit": 1e10}
PROJECTED_WORKERS = (8, 16, 32, 64, 128, 256, 512, 1024)
IDEAL_LINK = (10e-6, 25e9 / 8)  # (alpha, B): Horovod's network, assumed.


def ring_allreduce_seconds(workers, size_bytes, *, alpha, bandwidth,
                           packs=1):
  """Seconds of one step's ring all-reduces of `size_bytes` in `packs`."""
  if workers <= 1:
    return 0.0
  return (2 * (workers - 1) * alpha * packs
          + 2 * (workers - 1) / workers * size_bytes / bandwidth)


def step_seconds(workers, *, compute, size_bytes, alpha, bandwidth, phi=0.0,
                 packs=1):
  return compute + (1 - phi) * ring_allreduce_seconds(
      workers, size_bytes, alpha=alpha, bandwidth=bandwidth, packs=packs)


def efficiency(workers, **model):
  """Weak-scaling efficiency: one worker's step time over N workers'."""
  return model["compute"] / step_seconds(workers, **model)


def fit_phi(lab, shapes):
  """[phi of each round] from a lab run of configs C (overlapped) and
  C/serial on one link: phi = (T_serial - T_overlap) / T_link, with T_link
  the ring's bytes at the link's nominal rate (no probe fit there, so
  this is phi against the best case of the link)."""
  by_config = {r["config"]: r for r in lab["results"]}
  phis = []
  for name, serial in by_config.items():
    overlapped = by_config.get(name.partition("/")[0])
    if not name.endswith("/serial") or overlapped is None:
      continue
    payload = config_payload(overlapped["config"], shapes, 0)
    link = ring_allreduce_seconds(
        serial["workers"], payload.size_bytes, alpha=0.0,
        bandwidth=RATES_BITS[serial["link"]] / 8)
    phis.extend((t_serial - t_overlap) / link for t_serial, t_overlap in zip(
        serial["seconds_rounds"], overlapped["seconds_rounds"]))
  if not phis:
    raise ValueError("the overlap lab JSON needs configs C and C/serial")
  return phis


def fit_alpha_bandwidth(points: Sequence[Tuple[int, float, float]]):
  """(alpha seconds, B bytes/s) from [(workers, bytes, seconds)] of single
  all-reduces: least squares of t = 2(N-1) alpha + 2(N-1)/N S / B."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rows = np.array([[2 * (n - 1), 2 * (n - 1) / n * s] for n, s, _ in points])
  times = np.array([t for _, _, t in points])
  (alpha, inverse_bandwidth), *_ = np.linalg.lstsq(rows, times, rcond=None)
  return max(float(alpha), 0.0), 1.0 / float(inverse_bandwidth)


@dataclasses.dataclass(frozen=True)
class Payload:
  """What one worker all-reduces per step under one compression."""

  size_bytes: float
  packs: int


def payloads(shapes, *, rank=4, bytes_per_pack=0) -> Dict[str, Payload]:
  """float32, float16 and PowerSGD payloads of a model's gradient shapes."""
  from tfdist import compression  # pylint: disable=g-import-not-at-top
  elements = sum(math.prod(shape) for shape in shapes)
  sent, _ = compression.wire_elements(shapes, rank)

  def packs(size):
    return max(1, math.ceil(size / bytes_per_pack)) if bytes_per_pack else 1
  return {"float32": Payload(4 * elements, packs(4 * elements)),
          "float16": Payload(2 * elements, packs(2 * elements)),
          f"powersgd:{rank}": Payload(4 * sent, 2 * packs(4 * sent / 2))}


def config_payload(config, shapes, bytes_per_pack):
  name, _, rank = config.partition(":")
  if name == "powersgd":
    return payloads(shapes, rank=int(rank or 4),
                    bytes_per_pack=bytes_per_pack)[f"powersgd:{rank or 4}"]
  return payloads(shapes, bytes_per_pack=bytes_per_pack)[name]


def model_shapes(model, input_shape=(8, 8, 1), num_classes=10):
  from tfdist import quiet  # pylint: disable=g-import-not-at-top
  with quiet.native_stderr_captured():
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist import models  # pylint: disable=g-import-not-at-top
    built = models.build(model, input_shape=input_shape,
                         num_classes=num_classes)
    built(tf.zeros([1, *input_shape]))
  return [tuple(w.shape) for w in built.trainable_weights]


@dataclasses.dataclass
class Check:
  link: str
  workers: int
  config: str
  bytes_per_pack: int
  measured: float  # The fastest of the lab's rounds.
  predicted: float
  calibration: bool
  rounds: Tuple[float, ...] = ()
  median: float = 0.0  # Of the rounds; measured when there was one.

  @property
  def error(self):
    return self.predicted / self.measured - 1

  @property
  def median_error(self):
    return self.predicted / self.median - 1


def fastest_round(run):
  """A lab run's step time for the model: its fastest round."""
  return min(run.get("seconds_rounds") or [run["seconds_per_step"]])


def check_lab(lab, shapes) -> Tuple[List[Check], dict, dict]:
  """Predicted against measured step time for every lab run; returns the
  checks, the (alpha, B) fit per (link, workers) and T_compute per worker
  count. The fit is per worker count too: on the lab's 2-core host the
  tasks share the CPU that moves their packets, so B falls with N."""
  fits = {}
  for key in sorted({(p["link"], p["workers"]) for p in lab["probe"]}):
    fits[key] = fit_alpha_bandwidth(
        [(p["workers"], p["bytes"], p["seconds"]) for p in lab["probe"]
         if (p["link"], p["workers"]) == key])
  rates = {p["link"]: p["rate_bits"] for p in lab["probe"]}
  fastest = max(rates, key=rates.get)
  compute = {}
  for run in lab["results"]:
    if run["link"] == fastest and run["config"].startswith("powersgd") and (
        run["bytes_per_pack"] == 0):
      alpha, bandwidth = fits[fastest, run["workers"]]
      payload = config_payload(run["config"], shapes, 0)
      compute[run["workers"]] = fastest_round(run) - (
          ring_allreduce_seconds(run["workers"], payload.size_bytes,
                                 alpha=alpha, bandwidth=bandwidth,
                                 packs=payload.packs))
  checks = []
  for run in lab["results"]:
    alpha, bandwidth = fits[run["link"], run["workers"]]
    payload = config_payload(run["config"], shapes, run["bytes_per_pack"])
    predicted = step_seconds(
        run["workers"], compute=compute[run["workers"]],
        size_bytes=payload.size_bytes, alpha=alpha, bandwidth=bandwidth,
        phi=PHI_TFDIST, packs=payload.packs)
    checks.append(Check(
        run["link"], run["workers"], run["config"], run["bytes_per_pack"],
        fastest_round(run), predicted,
        calibration=(run["link"] == fastest
                     and run["config"].startswith("powersgd")
                     and run["bytes_per_pack"] == 0),
        rounds=tuple(run.get("seconds_rounds", ())),
        median=run["seconds_per_step"]))
  return checks, fits, compute


def _plot_checks(checks, path):
  plt = plotting.pyplot()
  fig, ax = plt.subplots(figsize=(5.5, 5))
  for check in checks:
    marker = "s" if check.calibration else "o"
    spread = [[0], [max(check.rounds) - check.measured]] if check.rounds \
        else None
    ax.errorbar(check.measured, check.predicted, xerr=spread, fmt=marker,
                capsize=2)
    ax.annotate(f"{check.link} {check.workers}w {check.config}",
                (check.measured, check.predicted), fontsize=6)
  top = max(max(c.measured, c.predicted) for c in checks) * 1.1
  ax.plot([0, top], [0, top], "k--", linewidth=0.8)
  ax.fill_between([0, top], [0, top * 0.85], [0, top * 1.15], alpha=0.1)
  ax.set_xlabel("measured s/step (lab: fastest round; bar: to the slowest)")
  ax.set_ylabel("predicted s/step (ring model)")
  ax.set_title("Lab step time: predicted vs measured (band: 15%)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _plot_projection(projections, model, path):
  plt = plotting.pyplot()
  fig, axes = plt.subplots(1, len(projections), figsize=(11, 4.2),
                           sharey=True, squeeze=False)
  for ax, (title, curves) in zip(axes[0], projections.items()):
    styles = {"float32": "-", "float16": "--"}
    colours = {}
    for label, values in curves.items():
      curve_model, compression_name = label.rsplit(" ", 1)
      colour = colours.setdefault(curve_model, f"C{len(colours)}")
      ax.plot(PROJECTED_WORKERS, [100 * v for v in values], marker=".",
              color=colour, linestyle=styles.get(compression_name, ":"),
              label=label)
    ax.axhline(90, color="k", linestyle=":", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylim(0, 101)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=6)
  axes[0][0].set_ylabel(f"projected efficiency (%), lab model {model}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def project(models_compute, fit, *, phi=PHI_TFDIST):
  """{label: [efficiency at each PROJECTED_WORKERS]} for each model and
  compression; models_compute: {model: (shapes, T_compute seconds)}.
  `phi` applies to the plain all-reduces; PowerSGD's is 0 (its
  collectives wait for every gradient)."""
  alpha, bandwidth = fit
  curves = {}
  for model, (shapes, compute) in models_compute.items():
    for name, payload in payloads(shapes).items():
      hidden = 0.0 if name.startswith("powersgd") else phi
      curves[f"{model} {name}"] = [
          efficiency(n, compute=compute, size_bytes=payload.size_bytes,
                     alpha=alpha, bandwidth=bandwidth, phi=hidden,
                     packs=payload.packs) for n in PROJECTED_WORKERS]
  return curves


def _other_models(lab, lab_compute, per_worker, names):
  """{model: (shapes, T_compute)} for other zoo models: their one-core
  step time, scaled by the lab model's lab/one-core ratio (the cost two
  synchronised workers add on this host)."""
  if not names:
    return {}
  import tempfile  # pylint: disable=g-import-not-at-top
  from tfdist.tools import netlab  # pylint: disable=g-import-not-at-top
  one_core = [c["seconds_one_core"] for c in lab["compute"]
              if c["batch"] == per_worker][0]
  found = {}
  with tempfile.TemporaryDirectory(prefix="tfdist-scaling-") as scratch:
    for name in names:
      seconds = netlab.compute_seconds(
          model=name, batch_size=per_worker, steps=40, log_every=10,
          data_dir="~/tensorflow_datasets",
          model_dir=os.path.join(scratch, name))
      found[name] = (model_shapes(name), seconds * lab_compute / one_core)
      print(f"  {name}: one core {seconds:.3f} s/step at batch {per_worker}"
            f" -> T_compute {found[name][1]:.3f} s", flush=True)
  return found


def main(argv):
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags_ = flags.FLAGS
  with open(flags_.lab_json) as source:
    lab = json.load(source)
  shapes = model_shapes(lab["model"])
  checks, fits, compute = check_lab(lab, shapes)
  print("Ring-model fit per lab link and worker count "
        "(tools.allreduce_probe):")
  for (link, n), (alpha, bandwidth) in fits.items():
    print(f"  {link}, {n} workers: alpha {alpha * 1e3:.2f} ms, B "
          f"{bandwidth * 8 / 1e9:.3f} Gbit/s")
  for n, seconds in sorted(compute.items()):
    one_core = [c["seconds_one_core"] for c in lab["compute"]
                if c["workers"] == n]
    print(f"  T_compute at {n} workers: {seconds:.3f} s/step" + (
        f" (one process on one core: {one_core[0]:.3f})" if one_core else ""))
  print("\n| link | workers | all-reduce | bytes_per_pack | measured s/step "
        "(fastest round) | median, slowest | predicted s/step | error | "
        "error vs median |")
  print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
  for c in checks:
    note = " (calibration)" if c.calibration else ""
    spread = f"{c.median:.3f}, {max(c.rounds):.3f}" if c.rounds else "-"
    print(f"| {c.link} | {c.workers} | {c.config} | {c.bytes_per_pack} | "
          f"{c.measured:.3f} | {spread} | {c.predicted:.3f} | "
          f"{100 * c.error:+.1f}%{note} | {100 * c.median_error:+.1f}% |")
  predictions = [c for c in checks if not c.calibration]
  worst = max(abs(c.error) for c in predictions)
  within = sum(abs(c.median_error) <= 0.15 for c in predictions)
  print(f"\nLargest prediction error: {100 * worst:.1f}% (against the "
        f"medians: {within} of {len(predictions)} within 15%). phi = "
        f"{PHI_TFDIST} (these runs predate --overlap_allreduce).")
  phi = PHI_TFDIST
  if flags_.overlap_json:
    with open(flags_.overlap_json) as source:
      overlap_lab = json.load(source)
    phis = fit_phi(overlap_lab, model_shapes(overlap_lab["model"]))
    phi = min(max(statistics.median(phis), 0.0), 1.0)
    print(f"phi fitted from {flags_.overlap_json} ({overlap_lab['model']}): "
          f"{phi:.2f}, median of {len(phis)} rounds [{min(phis):.2f}-"
          f"{max(phis):.2f}]; the projection uses it for the plain "
          "all-reduces, and 0 for PowerSGD.")
  per_worker = lab["batch_size"] // min(compute)
  models_compute = {lab["model"]: (shapes, compute[min(compute)])}
  models_compute.update(_other_models(lab, compute[min(compute)],
                                      per_worker, flags_.models))
  rates = {p["link"]: p["rate_bits"] for p in lab["probe"]}
  fastest = max(rates, key=rates.get)
  settings = {
      f"links like the lab's {fastest} (fitted at {min(compute)} workers)":
          fits[fastest, min(compute)],
      "Horovod's 25 Gbit/s with alpha = 10 us (assumed, not measured)":
          IDEAL_LINK}
  projections = {}
  for title, fit in settings.items():
    curves = project(models_compute, fit, phi=phi)
    projections[title] = curves
    print(f"\nProjected efficiency, {title}; per-worker batch {per_worker}, "
          "T_compute from the lab:")
    print("| model, all-reduce | " + " | ".join(map(str, PROJECTED_WORKERS))
          + " |")
    print("|---|" + "---:|" * len(PROJECTED_WORKERS))
    for label, values in curves.items():
      print(f"| {label} | " + " | ".join(f"{100 * v:.0f}%" for v in values)
            + " |")
  if flags_.plots:
    os.makedirs(flags_.plots, exist_ok=True)
    _plot_checks(checks, os.path.join(flags_.plots, "scaling_check.png"))
    _plot_projection(projections, lab["model"],
                     os.path.join(flags_.plots, "scaling_projection.png"))
    print(f"\nPlots: {flags_.plots}/scaling_check.png, "
          f"{flags_.plots}/scaling_projection.png")
  return 0


if __name__ == "__main__":
  from absl import app, flags as absl_flags  # pylint: disable=g-import-not-at-top,g-multiple-import
  absl_flags.DEFINE_string("lab_json", "docs/netlab.json",
                           "tools.netlab --json_out with --probe_sizes.")
  absl_flags.DEFINE_string("plots", "docs", "Write the PNG plots here; "
                           "empty: none.")
  absl_flags.DEFINE_string("overlap_json", "", "A tools.netlab JSON with "
                           "configs C and C/serial: fit phi from it.")
  absl_flags.DEFINE_list("models", [], "Also project these zoo models "
                         "(digits input), timing each on one core.")
  app.run(lambda argv: sys.exit(main(argv)))
