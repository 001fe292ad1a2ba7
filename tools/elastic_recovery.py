"""What a lost worker, or a preempted one, costs an elastic job: seconds
and steps, before and after tfdist's survivor state and warm spares.

python -m tools.elastic_recovery [--rounds=3] [--workers=3]

Each round runs four jobs, interleaved: a MultiWorkerMirrored job on
launch.local with --workers=(N-1):N, no restarts and --checkpoint_every=100,
whose worker N-1 gets, at step 60,
- SIGKILL (a VM lost without warning), the job as before this change
  (--survivor_state=false, --spares=0: a cold start from the last
  checkpoint), and as now (the survivors' state, warm spares);
- SIGTERM (a preemption: the group saves its step, exits 42 and
  resumes), with cold starts and with warm spares.
It reads the launcher's and the chief's lines as they come:
- stop:    the launcher's own figure for noticing the loss and stopping
           the group ("stopping the old group took ...");
- recover: from the signal to the first training step of the new group;
- redone:  the steps the old group had finished that the new group
           trains again (the last step the chief logged, less the step
           the new group starts from).
Then the job is stopped (Ctrl-C). It prints every run and, per case, the
median [min-max]. Digits and the MLP, as the elastic tests use;
steps_per_loop=1, so a step line comes at every step.
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
_STOPPED = re.compile(r"stopping the old group took ([0-9.]+)s")
# The job: the loss comes 60 steps into a checkpoint interval.
_CHECKPOINT_EVERY = 100
_KILL_AT = 60


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


# (name, signal, launcher and train flags of the case)
CASES = (
    ("SIGKILL, as before (cold start, last checkpoint)", signal.SIGKILL,
     ["--spares=0"], ["--survivor_state=false"]),
    ("SIGKILL, now (survivor state, warm spares)", signal.SIGKILL,
     ["--spares=auto"], []),
    ("SIGTERM preemption, cold start", signal.SIGTERM, ["--spares=0"], []),
    ("SIGTERM preemption, warm spares", signal.SIGTERM, ["--spares=auto"],
     []),
)


def _launch(workers, data_dir, model_dir, launcher_flags, train_flags):
  batch = 16 * workers * (workers - 1)  # Both counts divide it.
  return subprocess.Popen(
      [sys.executable, "-m", "launch.local",
       f"--workers={workers - 1}:{workers}", "--max_restarts=0",
       *launcher_flags, "--",
       "--strategy=multi_worker_mirrored", f"--model_dir={model_dir}",
       f"--data_dir={data_dir}", "--train_steps=1000000",
       f"--batch_size={batch}", "--steps_per_loop=1", "--log_every=1",
       f"--checkpoint_every={_CHECKPOINT_EVERY}", "--eval_every=0",
       *train_flags],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def one_round(workers, data_dir, model_dir, case):
  """(stop seconds, recover seconds, steps redone) of one fault."""
  _, signum, launcher_flags, train_flags = case
  launcher = _launch(workers, data_dir, model_dir, launcher_flags,
                     train_flags)
  pids, last_step, hit_at, restarted, stop = {}, 0, None, False, 0.0
  try:
    for line in launcher.stdout:
      started = _STARTED.match(line)
      if started:
        pids[started.group(1)] = int(started.group(2))
        restarted = hit_at is not None
      if _STOPPED.search(line):
        stop = float(_STOPPED.search(line).group(1))
      step = _STEP.match(line)
      if not step:
        continue
      if restarted:  # The new group's first step.
        # A preempted group may train a step it saves but never logs.
        return (stop, time.monotonic() - hit_at,
                max(last_step - (int(step.group(1)) - 1), 0))
      last_step = max(last_step, int(step.group(1)))
      if hit_at is None and last_step >= _KILL_AT:
        os.kill(pids[f"worker:{workers - 1}"], signum)
        hit_at = time.monotonic()
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
  results = {case[0]: [] for case in CASES}
  with tempfile.TemporaryDirectory(prefix="tfdist-recovery-") as root:
    data_dir = os.path.join(root, "data")
    subprocess.run([sys.executable, "-c", "import sys; from tfdist import "
                    "digits; digits.prepare(sys.argv[1])", data_dir],
                   check=True, capture_output=True)
    for k in range(args.rounds):
      for n, case in enumerate(CASES):
        stop, recover, redone = one_round(
            args.workers, data_dir, os.path.join(root, f"run{k}-{n}"), case)
        results[case[0]].append((stop, recover, redone))
        print(f"round {k + 1}, {case[0]}: stop {stop:.1f}s, recover "
              f"{recover:.1f}s, {redone} steps redone", flush=True)
  print(f"median [min-max] of {args.rounds} rounds, {args.workers} -> "
        f"{args.workers - 1} workers:")
  for name, rows in results.items():
    print(f"  {name}: stop {_summary([r[0] for r in rows])}s, recover "
          f"{_summary([r[1] for r in rows])}s, steps redone "
          f"{_summary([r[2] for r in rows])}")


if __name__ == "__main__":
  main()
