"""What a lost worker costs an elastic job: seconds and steps.

python -m tools.elastic_recovery [--rounds=3] [--workers=3]

Each round starts a MultiWorkerMirrored job on launch.local with
--workers=(N-1):N and no restarts, SIGKILLs worker N-1 once the chief
has saved its first checkpoint, and reads the launcher's and the chief's
lines as they come:
- stop:    the launcher's own figure for noticing the loss and stopping
           the group ("stopping the old group took ...");
- recover: from the SIGKILL to the first training step of the smaller
           group;
- redone:  the steps trained since the last checkpoint, which the new
           group trains again.
Then the job is stopped (Ctrl-C). It prints every round and the median
[min-max]. Digits and the MLP, as the elastic tests use; steps_per_loop=1,
so a step line comes at every step.
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

_STARTED = re.compile(r"^\[launch\] started (\S+) pid=(\d+)")
_STEP = re.compile(r"^worker:0 \| \S+ train step (\d+)/")
_RESUMED = re.compile(r"^worker:0 \| .*Resumed from .* at step (\d+)")
_STOPPED = re.compile(r"stopping the old group took ([0-9.]+)s")
_CHECKPOINT_EVERY = 50


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m tools.elastic_recovery")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--workers", type=int, default=3,
                      help="N: the job runs with --workers=(N-1):N.")
  args = parser.parse_args(argv)
  if args.rounds < 1 or args.workers < 2:
    parser.error(f"--rounds must be >= 1 and --workers >= 2. Received: "
                 f"rounds={args.rounds}, workers={args.workers}")
  return args


def one_round(workers, data_dir, model_dir):
  """(stop seconds, recover seconds, steps redone) of one lost worker."""
  batch = 16 * workers * (workers - 1)  # Both counts divide it.
  launcher = subprocess.Popen(
      [sys.executable, "-m", "launch.local",
       f"--workers={workers - 1}:{workers}", "--max_restarts=0", "--",
       "--strategy=multi_worker_mirrored", f"--model_dir={model_dir}",
       f"--data_dir={data_dir}", "--train_steps=1000000",
       f"--batch_size={batch}", "--steps_per_loop=1", "--log_every=1",
       f"--checkpoint_every={_CHECKPOINT_EVERY}", "--eval_every=0"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  pids, last_step, killed_at = {}, 0, None
  stop = resumed = None
  try:
    for line in launcher.stdout:
      started = _STARTED.match(line)
      if started:
        pids[started.group(1)] = int(started.group(2))
      step = _STEP.match(line)
      if step and killed_at is None:
        last_step = int(step.group(1))
        if last_step > _CHECKPOINT_EVERY:
          os.kill(pids[f"worker:{workers - 1}"], signal.SIGKILL)
          killed_at = time.monotonic()
      elif killed_at is not None:
        if _STOPPED.search(line):
          stop = float(_STOPPED.search(line).group(1))
        if _RESUMED.match(line):
          resumed = int(_RESUMED.match(line).group(1))
        if step and resumed is not None:
          return stop, time.monotonic() - killed_at, last_step - resumed
    raise RuntimeError("the job ended before it recovered")
  finally:
    launcher.send_signal(signal.SIGINT)
    try:
      launcher.communicate(timeout=120)
    except subprocess.TimeoutExpired:
      launcher.kill()


def _summary(values):
  return (f"{statistics.median(values):.1f} "
          f"[{min(values):.1f}-{max(values):.1f}]")


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  with tempfile.TemporaryDirectory(prefix="tfdist-recovery-") as root:
    data_dir = os.path.join(root, "data")
    subprocess.run([sys.executable, "-c", "import sys; from tfdist import "
                    "digits; digits.prepare(sys.argv[1])", data_dir],
                   check=True, capture_output=True)
    results = []
    for k in range(args.rounds):
      stop, recover, redone = one_round(
          args.workers, data_dir, os.path.join(root, f"run{k}"))
      results.append((stop, recover, redone))
      print(f"round {k + 1}: {args.workers} -> {args.workers - 1} workers: "
            f"stop {stop:.1f}s, recover {recover:.1f}s, {redone} steps "
            "redone", flush=True)
  print(f"median [min-max] of {args.rounds}: stop "
        f"{_summary([r[0] for r in results])}s, recover "
        f"{_summary([r[1] for r in results])}s, steps redone "
        f"{_summary([r[2] for r in results])}")


if __name__ == "__main__":
  main()
