"""A network lab: an unchanged tfdist job over emulated links.

sudo python -m tools.netlab --workers=2 --links=1gbit,100mbit \
    --configs=float32,float16,powersgd:4 [--bytes_per_pack=0,4194304] \
    [--model=mlp_wide] [--steps=40] [--rounds=3] [--json_out=lab.json]

Each task runs in its own network namespace, joined by a veth pair to a
Linux bridge in one more namespace; every link is shaped with `tc tbf` in
both directions (this kernel has no `netem`, so there is no latency
emulation: latency is only queueing). Addresses come from the benchmarking
range 198.18.0.0/15 and live only on the lab's veths, which have no route
anywhere else; every namespace is removed at the end, on Ctrl-C too, and
namespaces of a lab that was SIGKILLed are removed by the next one.

The job is the real launcher (launch.core) running `tfdist.train` with
multi_worker_mirrored, task k pinned to core k mod cores (so 2 workers
never share a core; unpinned, a lab run had float16 slower than float32
at 10 Gbit/s). Per step: wall time, and the bytes each worker sent and
received on its link, taken between the chief's progress lines after the
first (which holds tracing) and the last. --rounds repeats every
configuration, one round after another, and reports the median and the
spread.
"""

import contextlib
import dataclasses
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import List, Optional

from absl import app
from absl import flags

from tfdist import options
from tfdist.launch import core
from tfdist.launch import description
from tfdist.launch import isolation

# RFC 2544's benchmarking range; the lab never uses any other address.
BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")
LAB_NETWORK = ipaddress.ip_network("198.18.0.0/24")
assert LAB_NETWORK.subnet_of(BENCHMARK_RANGE)
TASK_PORT = 20000  # Each task has its own address, so one port serves all.
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}


def parse_rate(text):
  """'100mbit' -> 1e8 bits/s."""
  found = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit|bit)", text.strip())
  if not found or float(found.group(1)) <= 0:
    raise ValueError(f"a link rate is a number and kbit, mbit or gbit. "
                     f"Received: {text!r}")
  return float(found.group(1)) * _UNITS[found.group(2)]


def parse_config(text):
  """A lab configuration: (module, its flags).

  float32, float16, bfloat16, powersgd[:RANK] (float32 factors): tfdist,
  with its all-reduce overlapped; a "/serial" suffix turns the overlap off
  (--nooverlap_allreduce). raw: raw TF MWMS (tools.raw_mwms). alone: the
  default strategy in one process on one core at one worker's batch, with
  no network (the bar of the fixed cost).
  """
  if text in ("raw", "alone"):
    return (f"{__package__}.raw_mwms" if text == "raw" else "alone"), []
  base, _, suffix = text.partition("/")
  if suffix not in ("", "serial"):
    raise ValueError(f"a lab config's suffix is /serial. Received: {text!r}")
  extra = ["--nooverlap_allreduce"] if suffix else []
  name, _, rank = base.partition(":")
  if name in options.BY_NAME["allreduce_dtype"].choices and not rank:
    return "tfdist.train", [f"--allreduce_dtype={name}", *extra]
  if name == "powersgd" and (not rank or rank.isdigit() and int(rank) > 0):
    return "tfdist.train", ["--allreduce_compression=powersgd",
                            f"--powersgd_rank={rank or 4}", *extra]
  raise ValueError(f"a lab config is float32, float16, bfloat16 or "
                   f"powersgd[:RANK], with /serial or not, or raw or alone. "
                   f"Received: {text!r}")


def _ip(*args, check=True):
  return subprocess.run(["ip", *args], check=check, capture_output=True,
                        text=True)


class Lab:
  """Namespaces, veths, a bridge and shaped links for `tasks` tasks; a
  context manager that removes all of it."""

  def __init__(self, *, tasks, rate_bits, mtu=1500, cores=None):
    if not 1 <= tasks <= 250:
      raise ValueError(f"tasks must be 1 to 250 (one /24 of addresses). "
                       f"Received: tasks={tasks}")
    if not rate_bits > 0:
      raise ValueError(f"rate_bits must be > 0. Received: "
                       f"rate_bits={rate_bits}")
    if cores is not None and cores < 1:
      raise ValueError(f"cores must be >= 1 or None (no pinning). "
                       f"Received: cores={cores}")
    self.tasks = tasks
    self.rate_bits = rate_bits
    self.mtu = mtu
    self.cores = cores
    prefix = f"{isolation.PREFIX}{os.getpid()}-lab"
    self.bridge_ns = f"{prefix}-br"
    self.task_ns = [f"{prefix}-t{k}" for k in range(tasks)]
    self._made = []

  def address(self, k):
    return str(LAB_NETWORK.network_address + k + 1)

  def __enter__(self):
    isolation.remove_stale()
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc):
    self.close()

  def _netns(self, name):
    _ip("netns", "add", name)
    self._made.append(name)
    _ip("-n", name, "link", "set", "lo", "up")

  def _shape(self, namespace, device):
    # tbf: a bucket of 4 ms of the rate (at least 64 KB) and 50 ms of queue.
    rate_bytes = self.rate_bits / 8
    burst = max(int(rate_bytes * 0.004), 65536)
    subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev",
         device, "root", "tbf", "rate", f"{int(self.rate_bits)}bit",
         "burst", str(burst), "latency", "50ms"],
        check=True, capture_output=True, text=True)

  def _build(self):
    self._netns(self.bridge_ns)
    _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
    _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
    for k, namespace in enumerate(self.task_ns):
      self._netns(namespace)
      _ip("link", "add", "name", f"v{k}", "netns", namespace, "mtu",
          str(self.mtu), "type", "veth", "peer", "name", f"b{k}", "netns",
          self.bridge_ns, "mtu", str(self.mtu))
      _ip("-n", namespace, "addr", "add",
          f"{self.address(k)}/{LAB_NETWORK.prefixlen}", "dev", f"v{k}")
      _ip("-n", namespace, "link", "set", f"v{k}", "up")
      _ip("-n", self.bridge_ns, "link", "set", f"b{k}", "master", "br0")
      _ip("-n", self.bridge_ns, "link", "set", f"b{k}", "up")
      self._shape(namespace, f"v{k}")  # What task k sends.
      self._shape(self.bridge_ns, f"b{k}")  # What task k receives.

  def wrap(self, k, argv):
    """Task k's command: in its namespace, on core k mod cores."""
    pin = ["taskset", "-c", str(k % self.cores)] if self.cores else []
    return ["ip", "netns", "exec", self.task_ns[k], *pin, *argv]

  def counters(self):
    """[(sent, received) bytes] of each task's link, from the bridge side
    (one call: b<k> receives what task k sends)."""
    links = json.loads(_ip("-n", self.bridge_ns, "-s", "-j", "link",
                           "show").stdout)
    stats = {link["ifname"]: link["stats64"] for link in links}
    return [(stats[f"b{k}"]["rx"]["bytes"], stats[f"b{k}"]["tx"]["bytes"])
            for k in range(self.tasks)]

  def close(self):
    for name in reversed(self._made):
      _ip("netns", "del", name, check=False)
    self._made = []


@dataclasses.dataclass
class Sample:
  seconds: float
  step: int
  counters: list


@dataclasses.dataclass
class Result:
  """One configuration on one link: per-step means over the steady part."""

  link: str
  workers: int
  config: str
  bytes_per_pack: int
  seconds_per_step: float
  sent_per_step: List[float]  # Bytes, one per task.
  received_per_step: List[float]
  accuracy: Optional[float]
  steps_measured: int
  seconds_rounds: List[float] = dataclasses.field(default_factory=list)


def combine(rounds):
  """One Result from the same configuration's rounds: the median step time
  (each round's in seconds_rounds) and accuracy, and mean bytes."""
  first = rounds[0]
  if any((r.link, r.workers, r.config, r.bytes_per_pack) !=
         (first.link, first.workers, first.config, first.bytes_per_pack)
         for r in rounds):
    raise ValueError("combine takes rounds of one configuration")

  def mean(lists):
    return [statistics.fmean(values) for values in zip(*lists)]
  seconds = [r.seconds_per_step for r in rounds]
  accuracies = [r.accuracy for r in rounds if r.accuracy is not None]
  return dataclasses.replace(
      first, seconds_per_step=statistics.median(seconds),
      accuracy=statistics.median(accuracies) if accuracies else None,
      sent_per_step=mean([r.sent_per_step for r in rounds]),
      received_per_step=mean([r.received_per_step for r in rounds]),
      seconds_rounds=seconds)


_STEP = re.compile(r"train step (\d+)/\d+")  # tfdist.train's progress.
_PROGRESS = re.compile(r"^worker:0 \| .*" + _STEP.pattern)
_FINISHED = re.compile(r"^worker:0 \| Finished at step .*eval accuracy "
                       r"([0-9.]+)")


class _Tap:
  """The launcher's output stream: samples the links at each progress line
  of worker:0 (the chief of an MWMS job without a chief task), and echoes
  every line when verbose."""

  def __init__(self, lab, verbose):
    self._lab = lab
    self._verbose = verbose
    self._lock = threading.Lock()
    self.samples = []
    self.accuracy = None
    self.lines = []

  def write(self, text):
    with self._lock:
      for line in text.splitlines():
        self.lines.append(line)
        progress = _PROGRESS.match(line)
        if progress:
          self.samples.append(Sample(time.monotonic(),
                                     int(progress.group(1)),
                                     self._lab.counters()))
        finished = _FINISHED.match(line)
        if finished:
          self.accuracy = float(finished.group(1))
        if self._verbose:
          print(line, flush=True)

  def flush(self):
    pass


def run_job(lab, *, workers, train_args, verbose=False,
            module="tfdist.train"):
  """Runs one MWMS job in the lab; returns the _Tap with its samples.
  Raises RuntimeError when the job fails."""
  cluster = description.ClusterDescription(workers=workers)
  addresses = {"worker": [f"{lab.address(k)}:{TASK_PORT}"
                          for k in range(workers)]}
  specs = description.task_commands(cluster, addresses=addresses,
                                    module=module, train_args=train_args)
  tasks = [dataclasses.replace(spec, argv=lab.wrap(k, spec.argv))
           for k, spec in enumerate(specs)]
  args = SimpleNamespace(cluster=cluster, max_restarts=0, backoff_seconds=1.0,
                         stop_grace_seconds=10.0)
  tap = _Tap(lab, verbose)
  code = core.Launcher(args, make_tasks=lambda _: tasks, out=tap).run()
  if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
    raise KeyboardInterrupt
  if code != 0:
    tail = "\n".join(tap.lines[-15:])
    raise RuntimeError(f"the lab job exited {code}:\n{tail}")
  return tap


def _steady(samples):
  """The second and the last sample: the first interval holds tracing."""
  if len(samples) < 3:
    raise RuntimeError("too few progress lines to measure: raise --steps "
                       "or lower --log_every")
  return samples[1], samples[-1]


def measure(tap, *, link, workers, config, bytes_per_pack):
  """Per-step figures between progress lines, but the first interval."""
  first, last = _steady(tap.samples)
  steps = last.step - first.step
  per_step = [[(b - a) / steps for a, b in zip(start, end)]
              for start, end in zip(first.counters, last.counters)]
  return Result(link=link, workers=workers, config=config,
                bytes_per_pack=bytes_per_pack,
                seconds_per_step=(last.seconds - first.seconds) / steps,
                sent_per_step=[p[0] for p in per_step],
                received_per_step=[p[1] for p in per_step],
                accuracy=tap.accuracy, steps_measured=steps)


_PROBE = re.compile(r"^worker:0 \| probe bytes=(\d+) seconds=([0-9.]+)")


def probe(lab, *, workers, sizes, verbose=False):
  """[(bytes, seconds)] of one ring all-reduce per size (tools.allreduce_probe)
  on this lab's links."""
  # tools.allreduce_probe in a checkout, tfdist.tools.allreduce_probe
  # installed.
  tap = run_job(lab, workers=workers,
                module=f"{__package__}.allreduce_probe",
                train_args=[f"--sizes={','.join(map(str, sizes))}"],
                verbose=verbose)
  return [(int(m.group(1)), float(m.group(2)))
          for m in map(_PROBE.match, tap.lines) if m]


def compute_seconds(*, model, batch_size, steps, log_every, data_dir,
                    model_dir):
  """Seconds per step of one process on one core (taskset), no all-reduce:
  T_compute of the scaling model, at a worker's batch."""
  argv = ["taskset", "-c", "0", sys.executable, "-m", "tfdist.train",
          "--strategy=default", f"--model={model}", "--dataset=digits",
          f"--data_dir={data_dir}", f"--model_dir={model_dir}",
          f"--train_steps={steps}", f"--log_every={log_every}",
          f"--steps_per_loop={log_every}", f"--batch_size={batch_size}",
          "--eval_every=0", "--checkpoint_every=0", "--noexport"]
  samples = []
  with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, env={**os.environ,
                                        "PYTHONUNBUFFERED": "1"}) as proc:
    for line in proc.stdout:
      found = _STEP.search(line)
      if found:
        samples.append(Sample(time.monotonic(), int(found.group(1)), []))
  if proc.returncode != 0:
    raise RuntimeError(f"the one-core compute run of {model} exited "
                       f"{proc.returncode}")
  first, last = _steady(samples)
  return (last.seconds - first.seconds) / (last.step - first.step)


def train_args(*, model, steps, log_every, batch_size, data_dir, model_dir,
               config_flags, bytes_per_pack):
  return ["--strategy=multi_worker_mirrored", f"--model={model}",
          "--dataset=digits", f"--data_dir={data_dir}",
          f"--model_dir={model_dir}", f"--train_steps={steps}",
          f"--log_every={log_every}", f"--steps_per_loop={log_every}",
          f"--batch_size={batch_size}", "--eval_every=0",
          "--checkpoint_every=0", "--noexport", "--all_reduce_alg=ring",
          f"--bytes_per_pack={bytes_per_pack}", *config_flags]


def speedups(result, reference):
  """reference s/step / result s/step of each round (rounds run one after
  another, so round k of both shared the host's state)."""
  return [ref / mine for ref, mine in zip(reference.seconds_rounds,
                                          result.seconds_rounds)]


def table(results, versus="float32"):
  """A markdown table, with each config's speed-up over `versus` on the
  same link, worker count and pack size: the median of the per-round
  ratios and their spread."""
  base = {(r.link, r.workers, r.bytes_per_pack): r
          for r in results if r.config == versus}
  lines = ["| link | workers | config | bytes_per_pack | s/step | "
           "rounds (min-max) | sent MB/step/worker | "
           f"received MB/step/worker | vs {versus}, per round | accuracy |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in results:
    reference = base.get((r.link, r.workers, r.bytes_per_pack))
    speedup = "-"
    if reference is not None and reference is not r:
      ratios = speedups(r, reference)
      speedup = (f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-"
                 f"{max(ratios):.2f}]")
    accuracy = f"{r.accuracy:.4f}" if r.accuracy is not None else "-"
    sent = sum(r.sent_per_step) / len(r.sent_per_step) / 1e6
    received = sum(r.received_per_step) / len(r.received_per_step) / 1e6
    spread = (f"{len(r.seconds_rounds)}: {min(r.seconds_rounds):.3f}-"
              f"{max(r.seconds_rounds):.3f}" if r.seconds_rounds else "1")
    lines.append(f"| {r.link} | {r.workers} | {r.config} | "
                 f"{r.bytes_per_pack} | {r.seconds_per_step:.3f} | {spread} | "
                 f"{sent:.3f} | {received:.3f} | {speedup} | {accuracy} |")
  return "\n".join(lines)


FLAGS = flags.FLAGS
flags.DEFINE_list("workers", ["2"], "Worker counts (2-4).")
flags.DEFINE_list("links", ["1gbit"], "Link rates, e.g. 100mbit,1gbit.")
flags.DEFINE_list("configs", ["float32", "powersgd:4"],
                  "float32, float16, bfloat16, powersgd[:RANK] (each "
                  "with /serial: no overlap), raw (raw TF MWMS) or alone "
                  "(one process, one core, one worker's batch).")
flags.DEFINE_list("bytes_per_pack", ["0"], "--bytes_per_pack values.")
flags.DEFINE_string("model", "mlp_wide", "Model from the zoo.")
flags.DEFINE_integer("steps", 40, "Train steps per run.")
flags.DEFINE_integer("rounds", 1, "Runs of every configuration; the table "
                     "gives the median and the spread.")
flags.DEFINE_bool("pin", True, "Pin lab task k to core k mod cores.")
flags.DEFINE_integer("log_every", 10, "Steps between samples.")
flags.DEFINE_integer("batch_size", 64, "Global batch.")
flags.DEFINE_string("versus", "float32", "The config the table's speed-ups "
                    "are against.")
flags.DEFINE_integer("mtu", 1500, "MTU of the lab's veths.")
flags.DEFINE_string("data_dir", "~/tensorflow_datasets", "tfds data_dir.")
flags.DEFINE_string("json_out", "", "Also write the results here (JSON).")
flags.DEFINE_bool("verbose", False, "Echo the jobs' output.")
flags.DEFINE_list("probe_sizes", [], "Also time one all-reduce of each of "
                  "these byte sizes on every link and worker count "
                  "(tools.allreduce_probe), and each worker's compute alone "
                  "on one core: the inputs of tools.scaling.")


def _check_flags():
  """The flags as values; ValueError names a bad one."""
  workers = [int(w) for w in FLAGS.workers]
  if any(not 2 <= w <= 4 for w in workers):
    raise ValueError(f"--workers takes 2 to 4. Received: {FLAGS.workers}")
  rates = [(link, parse_rate(link)) for link in FLAGS.links]
  configs = [(config, parse_config(config)) for config in FLAGS.configs]
  packs = [int(p) for p in FLAGS.bytes_per_pack]
  if FLAGS.rounds < 1:
    raise ValueError(f"--rounds must be >= 1. Received: {FLAGS.rounds}")
  if FLAGS.steps < 3 * FLAGS.log_every:
    raise ValueError(f"--steps must be at least 3 x --log_every. Received: "
                     f"steps={FLAGS.steps}, log_every={FLAGS.log_every}")
  return workers, rates, configs, packs


def _raise_on_sigterm(signum, frame):
  del frame
  raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _lab_session(workers, rate):
  """A Lab, with SIGTERM as Ctrl-C around it; launch.core takes the
  signals over while a job runs, and Ctrl-C is taken back after."""
  signal.signal(signal.SIGTERM, _raise_on_sigterm)
  try:
    with Lab(tasks=workers, rate_bits=rate, mtu=FLAGS.mtu,
             cores=os.cpu_count() if FLAGS.pin else None) as lab:
      yield lab
  finally:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv):
  del argv
  if os.geteuid() != 0 or not shutil.which("tc"):
    print("tools.netlab: skipped: needs root, ip and tc (network "
          "namespaces and traffic shaping).")
    return 0
  try:
    workers_list, rates, configs, packs = _check_flags()
  except ValueError as e:
    print(f"tools.netlab: error: {e}", file=sys.stderr)
    return 2
  print("Links shaped with tc tbf in both directions; this kernel has no "
        "netem, so latency is queueing only (no propagation delay).",
        flush=True)
  try:
    results = _run_all(workers_list, rates, configs, packs)
  except KeyboardInterrupt:
    print("tools.netlab: interrupted; every lab namespace was removed.",
          file=sys.stderr)
    return 130
  except (RuntimeError, subprocess.CalledProcessError) as e:
    detail = getattr(e, "stderr", None) or str(e)
    print(f"tools.netlab: error: {detail}", file=sys.stderr)
    return 1
  extra = {}
  if FLAGS.probe_sizes:
    try:
      extra = _probe_all(workers_list, rates)
    except KeyboardInterrupt:
      print("tools.netlab: interrupted; every lab namespace was removed.",
            file=sys.stderr)
      return 130
  print(f"\nModel {FLAGS.model}, global batch {FLAGS.batch_size}, "
        f"{FLAGS.steps} steps per run, measured over the last "
        f"{results[0].steps_measured}; median of {FLAGS.rounds} "
        f"round(s); tasks {'pinned to cores' if FLAGS.pin else 'unpinned'}.")
  print(table(results, FLAGS.versus))
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as out:
      json.dump({"model": FLAGS.model, "batch_size": FLAGS.batch_size,
                 "rounds": FLAGS.rounds, "pinned": FLAGS.pin,
                 "results": [dataclasses.asdict(r) for r in results],
                 **extra}, out, indent=1)
  return 0


def _probe_all(workers_list, rates):
  """All-reduce times per link and worker count, and one-core compute
  times per worker batch."""
  sizes = [int(size) for size in FLAGS.probe_sizes]
  points = []
  for link, rate in rates:
    for workers in workers_list:
      with _lab_session(workers, rate) as lab:
        measured = probe(lab, workers=workers, sizes=sizes,
                         verbose=FLAGS.verbose)
      for size, seconds in measured:
        print(f"probe {link} {workers} workers: {size} bytes in "
              f"{seconds * 1e3:.1f} ms", flush=True)
        points.append({"link": link, "rate_bits": rate, "workers": workers,
                       "bytes": size, "seconds": seconds})
  compute = []
  with tempfile.TemporaryDirectory(prefix="tfdist-netlab-") as scratch:
    for workers in workers_list:
      batch = FLAGS.batch_size // workers
      seconds = compute_seconds(
          model=FLAGS.model, batch_size=batch, steps=FLAGS.steps,
          log_every=FLAGS.log_every, data_dir=FLAGS.data_dir,
          model_dir=os.path.join(scratch, str(workers)))
      print(f"compute alone on one core, batch {batch}: {seconds:.3f} "
            "s/step", flush=True)
      compute.append({"workers": workers, "batch": batch,
                      "seconds_one_core": seconds})
  return {"probe": points, "compute": compute, "cores": os.cpu_count()}


def _run_all(workers_list, rates, configs, packs):
  """Every configuration once per round, rounds one after another (so a
  slow spell of the host touches every configuration alike); one combined
  Result per configuration."""
  rounds = {}
  run_index = itertools.count()
  with tempfile.TemporaryDirectory(prefix="tfdist-netlab-") as scratch:
    for round_index in range(FLAGS.rounds):
      for link, rate in rates:
        for workers in workers_list:
          for pack in packs:
            for name, (module, config_flags) in configs:
              model_dir = os.path.join(scratch, str(next(run_index)))
              if module == "alone":
                r = Result(link=link, workers=workers, config=name,
                           bytes_per_pack=pack, seconds_per_step=(
                               compute_seconds(
                                   model=FLAGS.model,
                                   batch_size=FLAGS.batch_size // workers,
                                   steps=FLAGS.steps,
                                   log_every=FLAGS.log_every,
                                   data_dir=FLAGS.data_dir,
                                   model_dir=model_dir)),
                           sent_per_step=[0.0], received_per_step=[0.0],
                           accuracy=None, steps_measured=0)
              else:
                with _lab_session(workers, rate) as lab:
                  tap = run_job(lab, workers=workers, verbose=FLAGS.verbose,
                                module=module, train_args=train_args(
                                    model=FLAGS.model, steps=FLAGS.steps,
                                    log_every=FLAGS.log_every,
                                    batch_size=FLAGS.batch_size,
                                    data_dir=FLAGS.data_dir,
                                    model_dir=model_dir,
                                    config_flags=config_flags,
                                    bytes_per_pack=pack))
                r = measure(tap, link=link, workers=workers, config=name,
                            bytes_per_pack=pack)
              rounds.setdefault((link, workers, pack, name), []).append(r)
              print(f"round {round_index + 1}/{FLAGS.rounds}: {link} "
                    f"{workers} workers {name} pack {pack}: "
                    f"{r.seconds_per_step:.3f} s/step, "
                    f"{sum(r.sent_per_step) / workers / 1e6:.3f} MB sent per "
                    f"worker per step, accuracy {r.accuracy}", flush=True)
  return [combine(found) for found in rounds.values()]


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
