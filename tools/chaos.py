"""Randomised fault injection (Jepsen-style) against a launch.local job.

python -m tools.chaos --duration=300 --kill_every=20-40 [--seed=0]
    [--baseline] [--elastic] -- <launch.local flags> -- <tfdist.train flags>

The job runs under launch.local with a generous --max_restarts. For the
first --duration seconds, at random intervals drawn from --kill_every, a
random task (chief, worker, ps or evaluator) gets SIGKILL or SIGTERM. When
the job ends, a report says what was injected and whether anything was
lost: the exit code, the restarts, the checkpoint step against
--train_steps, the eval accuracy (against a fault-free run of the same
flags with --baseline), whether the export loads and predicts, and
whether any task process, scratch file or network namespace was left
behind. Exit code 0 when nothing was lost.

The job's length is the chaos duration, not a step count: the chaos run
trains with --callbacks=tfdist.tools.chaos:hold_until_released, which
slows the chief (0.5 s per loop call) while a gate file exists and holds
it from 80% of --train_steps on until the gate goes, when the faults are
done. So every machine, fast or
slow, sees the same number of faults, and the job then finishes.

With --elastic (the launcher flags give --workers=MIN:MAX), half of the
faults instead change the worker slots a discovery script offers, to a
random count in MIN..MAX: the job shrinks and grows as it runs, and the
report counts the membership changes.
"""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

# The file whose presence holds the chief (hold_until_released).
GATE_ENV = "TFDIST_CHAOS_GATE"
HOLD_FROM = 0.8  # Of --train_steps.
THROTTLE_SECONDS = 0.5  # After each loop call while faults come.
HOLD_CALLBACK = "--callbacks=tfdist.tools.chaos:hold_until_released"

_STARTED = re.compile(r"^\[launch\] started (\S+) pid=(\d+) at (\S+)")
_ACCURACY = re.compile(r"Finished at step (\d+)/(\d+) .*eval accuracy "
                       r"([0-9.]+)")


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m tools.chaos")
  parser.add_argument("--duration", type=float, default=300,
                      help="Seconds during which faults are injected.")
  parser.add_argument("--kill_every", default="20-40",
                      help="MIN-MAX seconds between faults.")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--baseline", action="store_true",
                      help="First run the same flags without faults, to "
                      "compare eval accuracy.")
  parser.add_argument("--elastic", action="store_true",
                      help="Also remove and add workers at random "
                      "(needs --workers=MIN:MAX in the launcher flags).")
  parser.add_argument("--json", default=None, help="Write the report here.")
  parser.add_argument("rest", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
  if "--" not in rest:
    parser.error("give -- <launch.local flags> -- <tfdist.train flags>")
  split = rest.index("--")
  args.launcher_args, args.train_args = rest[:split], rest[split + 1:]
  low, _, high = args.kill_every.partition("-")
  args.kill_range = (float(low), float(high or low))
  flags = dict(a[2:].split("=", 1) for a in args.train_args
               if a.startswith("--") and "=" in a)
  if "model_dir" not in flags or "train_steps" not in flags:
    parser.error("the train flags need --model_dir and --train_steps")
  if "callbacks" in flags:
    parser.error("the train flags cannot give --callbacks: the chaos run "
                 "holds its end with its own")
  args.model_dir, args.train_steps = flags["model_dir"], int(
      flags["train_steps"])
  args.worker_range = None
  if args.elastic:
    workers = [a.split("=", 1)[1] for a in args.launcher_args
               if a.startswith("--workers=")]
    low, colon, high = (workers or [""])[-1].partition(":")
    if not (colon and low.isdigit() and high.isdigit()):
      parser.error("--elastic needs --workers=MIN:MAX in the launcher flags")
    args.worker_range = (int(low), int(high))
  return args


def hold_until_released():
  """--callbacks for a chaos run: on the chief, while the file GATE_ENV
  names exists, each loop call waits THROTTLE_SECONDS, and from HOLD_FROM
  of the train steps on it waits until the file goes (the other workers
  wait in their next collective)."""
  import keras  # pylint: disable=g-import-not-at-top
  gate = os.environ.get(GATE_ENV)

  class HoldUntilReleased(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      if not gate or not os.path.exists(gate):
        return
      # Slowed while faults come, so that most of them meet a job that
      # trains (and saves on SIGTERM) rather than one held at its end.
      time.sleep(THROTTLE_SECONDS)
      steps = self.params.get("steps") or 0
      if batch >= HOLD_FROM * steps:
        while os.path.exists(gate):
          time.sleep(0.2)
  return [HoldUntilReleased()]


class _Job:
  """launch.local in a subprocess, its output followed line by line."""

  def __init__(self, launcher_args, train_args, scratch, gate=None):
    self.lines, self.tasks, self.pids_seen = [], {}, set()
    env = {**os.environ, "TMPDIR": scratch}
    if gate:
      env[GATE_ENV] = gate
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "tfdist.launch.local", *launcher_args, "--",
         *train_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line)
      found = _STARTED.match(line)
      if found:
        self.tasks[found.group(1)] = int(found.group(2))
        self.pids_seen.add(int(found.group(2)))

  def wait(self):
    code = self.proc.wait()
    self._reader.join(timeout=10)
    return code


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:  # A zombie is not alive.
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except OSError:
    return False


def _export_predicts(model_dir):
  code = ("import sys, numpy as np, tensorflow as tf; "
          "f = tf.saved_model.load(sys.argv[1]).signatures['serving_default']; "
          "spec = list(f.structured_input_signature[1].values())[0]; "
          "shape = [2] + [d or 1 for d in spec.shape[1:]]; "
          "out = f(**{spec.name: tf.zeros(shape, spec.dtype)}); "
          "print(sorted(out))")
  proc = subprocess.run([sys.executable, "-c", code,
                         os.path.join(model_dir, "export")],
                        capture_output=True, text=True, timeout=300)
  return proc.returncode == 0


def _checkpoint_step(model_dir):
  code = ("import sys, tensorflow as tf; r = tf.train.load_checkpoint("
          "tf.train.latest_checkpoint(sys.argv[1])); "
          "print(int(r.get_tensor('step/.ATTRIBUTES/VARIABLE_VALUE')))")
  proc = subprocess.run([sys.executable, "-c", code, model_dir],
                        capture_output=True, text=True, timeout=300)
  return int(proc.stdout.strip()) if proc.returncode == 0 else None


def _accuracy(lines):
  found = [m for m in map(_ACCURACY.search, lines) if m]
  return float(found[-1].group(3)) if found else None


def _baseline_accuracy(args, launcher):
  """The eval accuracy of the same flags without faults."""
  base_dir = args.model_dir.rstrip("/") + "_baseline"
  train = [a if not a.startswith("--model_dir=") else
           f"--model_dir={base_dir}" for a in args.train_args]
  with tempfile.TemporaryDirectory(prefix="tfdist-chaos-") as scratch:
    base = _Job(launcher, train, scratch)
    base.wait()
  return _accuracy(base.lines)


def _one_fault(job, args, rng, slots, since_start):
  """Injects one fault: a new slot count (elastic, half the time) or a
  signal to a random task. Returns its record, or None when the task
  drawn is between its exit and its restart."""
  if args.worker_range and rng.random() < 0.5:
    count = rng.randint(*args.worker_range)
    with open(slots, "w") as f:
      f.write(f"localhost:{count}\n")
    return {"at": since_start, "task": "slots", "signal": f"{count}"}
  if not job.tasks:
    return None
  name = rng.choice(sorted(job.tasks))
  signum = rng.choice([signal.SIGKILL, signal.SIGTERM])
  try:
    os.kill(job.tasks[name], signum)
  except ProcessLookupError:
    return None
  return {"at": since_start, "task": name,
          "signal": signal.Signals(signum).name}


def _inject_until_done(job, args, rng, slots, gate, report, out):
  """Faults at random intervals for --duration seconds; then the gate
  goes and the job may finish."""
  started = time.monotonic()
  next_fault = started + rng.uniform(*args.kill_range)
  while job.proc.poll() is None:
    now = time.monotonic()
    if now - started >= args.duration and os.path.exists(gate):
      os.remove(gate)  # The faults are done: the job may finish.
      print(f"[chaos] {now - started:6.1f}s faults done; the job "
            "finishes", file=out, flush=True)
    if (now >= next_fault and now - started < args.duration
        and (job.tasks or args.worker_range)):
      fault = _one_fault(job, args, rng, slots, round(now - started, 1))
      if fault is None:
        next_fault = now + 1.0  # Between a task's exit and its restart.
      else:
        report["faults"].append(fault)
        shown = (f"slots -> {fault['signal']}" if fault["task"] == "slots"
                 else f"{fault['signal']} -> {fault['task']}")
        print(f"[chaos] {now - started:6.1f}s {shown}", file=out,
              flush=True)
        next_fault = now + rng.uniform(*args.kill_range)
    time.sleep(0.1)
  report["exit_code"] = job.wait()
  report["seconds"] = round(time.monotonic() - started, 1)


def _what_was_lost(report, args):
  lost = []
  if report["exit_code"] != 0:
    lost.append(f"exit code {report['exit_code']}")
  if report["checkpoint_step"] != args.train_steps:
    lost.append(f"checkpoint at step {report['checkpoint_step']}, not "
                f"{args.train_steps}")
  if not report["export_predicts"]:
    lost.append("the export does not load and predict")
  if report["leftover_processes"] or report["leftover_files"] or (
      report["leftover_namespace"]):
    lost.append("something was left behind")
  base = report.get("baseline_accuracy")
  if base is not None and (report["accuracy"] is None or
                           abs(report["accuracy"] - base) > 0.01):
    lost.append(f"accuracy {report['accuracy']} vs fault-free {base}")
  return lost


def run_chaos(args, out=sys.stdout):
  rng = random.Random(args.seed)
  launcher = [*args.launcher_args, "--max_restarts=1000",
              "--backoff_seconds=0.5", "--stop_grace_seconds=10"]
  report = {"seed": args.seed, "duration": args.duration, "faults": []}
  if args.baseline:
    report["baseline_accuracy"] = _baseline_accuracy(args, launcher)
  with tempfile.TemporaryDirectory(prefix="tfdist-chaos-") as scratch:
    slots = os.path.join(scratch, "slots")
    if args.worker_range:
      with open(slots, "w") as f:
        f.write(f"localhost:{args.worker_range[1]}\n")
      launcher += [f"--host_discovery=cat {slots}", "--discovery_seconds=1"]
    gate = os.path.join(scratch, "gate")
    open(gate, "w").close()
    job = _Job(launcher, [*args.train_args, HOLD_CALLBACK], scratch, gate)
    _inject_until_done(job, args, rng, slots, gate, report, out)
    time.sleep(1.0)  # Let the launcher's last children be reaped.
    report["leftover_files"] = sorted(
        f for f in os.listdir(scratch) if f not in ("slots", "gate"))
  report["restarts"] = sum("restarting" in l for l in job.lines)
  report["membership_changes"] = [
      l.split("membership change: ", 1)[1].split(" (")[0]
      for l in job.lines if "membership change: " in l]
  report["leftover_processes"] = sorted(p for p in job.pids_seen
                                        if _alive(p))
  namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True,
                              text=True).stdout if os.geteuid() == 0 else ""
  report["leftover_namespace"] = f"tfdist-{job.proc.pid}" in namespaces
  report["checkpoint_step"] = _checkpoint_step(args.model_dir)
  report["train_steps"] = args.train_steps
  report["accuracy"] = _accuracy(job.lines)
  report["export_predicts"] = _export_predicts(args.model_dir)
  report["lost"] = _what_was_lost(report, args)
  _print_report(report, out)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return report


def _print_report(report, out):
  kinds = {}
  for fault in report["faults"]:
    key = f"{fault['signal']} {fault['task'].split(':')[0]}"
    kinds[key] = kinds.get(key, 0) + 1
  lines = [
      "", "chaos report",
      f"  faults injected: {len(report['faults'])} "
      f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items())) or 'none'})",
      f"  restarts:        {report['restarts']}",
      f"  membership:      "
      f"{', '.join(report['membership_changes']) or 'no change'}",
      f"  exit code:       {report['exit_code']} after {report['seconds']}s",
      f"  checkpoint step: {report['checkpoint_step']} of "
      f"{report['train_steps']}",
      f"  eval accuracy:   {report['accuracy']}"
      + (f" (fault-free run: {report['baseline_accuracy']})"
         if "baseline_accuracy" in report else ""),
      f"  export predicts: {report['export_predicts']}",
      f"  left behind:     processes {report['leftover_processes'] or 'none'}"
      f", scratch files {report['leftover_files'] or 'none'}, namespace "
      f"{'yes' if report['leftover_namespace'] else 'none'}",
      f"  lost:            {'; '.join(report['lost']) or 'nothing'}",
  ]
  print("\n".join(lines), file=out, flush=True)


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  report = run_chaos(args)
  sys.exit(1 if report["lost"] else 0)


if __name__ == "__main__":
  main()
