"""launch.sweep over a real local Ray Tune (in a private network namespace,
as in test_ray.py): 4 digits trials, ASHA, an interruption and a resume,
the ranked table and the HParams every trial logged."""

import os
import re
import signal
import subprocess
import sys

import pytest
import tensorflow as tf
import yaml

import artifacts
from conftest import ROOT

# Kills processes, times out or owns a daemon: run alone (.ci/run).
pytestmark = pytest.mark.serial

pytest.importorskip("ray.tune", reason="needs the ray extra")

# Flags after -- override the file's; the file's own 600 steps leave the
# trial cut off at step 200 time to be cut off mid-run.
TRAIN_STEPS = 600
_ROW = re.compile(r"^(\d+)\s+(\w+_\d+)\s+(\d+)\s+(\S+)\s+(adam|sgd)\s+"
                  r"([0-9.]+)\s+(\d+)\s+(\d+)( \(stopped\))?\s+(\S+)$")


def _sweep(netns, space, sweep_dir, data_dir):
  return subprocess.Popen(
      [*netns, sys.executable, "-m", "launch.sweep", f"--space={space}",
       "--trials=4", "--max_concurrent=2", f"--sweep_dir={sweep_dir}",
       "--seed=0", "--", f"--data_dir={data_dir}",
       f"--train_steps={TRAIN_STEPS}"],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sweep_stops_weak_trials_and_resumes(netns, tmp_path, data_dir):
  sweep_dir = tmp_path / "sweeps"
  first = _sweep(netns, "configs/sweep_digits.yaml", sweep_dir, data_dir)
  lines, done, steps = [], set(), {}
  for line in first.stdout:
    lines.append(line)
    found = re.match(r"\[sweep\] (\w+_\d+) (?:step (\d+):|(finished|stopped))",
                     line)
    if found and found.group(2):
      steps[found.group(1)] = int(found.group(2))
    elif found and found.group(3):
      done.add(found.group(1))
    # Interrupt once one trial is done and another is mid-run, past its
    # step-100 checkpoint (its step-200 eval comes after that save).
    mid_run = {t for t, step in steps.items() if step >= 200} - done
    if done and mid_run:
      first.send_signal(signal.SIGINT)
      break
  rest, _ = first.communicate(timeout=180)
  first_output = "".join(lines) + rest
  assert first.returncode == 128 + signal.SIGINT, first_output[-3000:]
  assert "trial(s) unfinished; run the same command again" in first_output
  done_first = set(re.findall(r"\[sweep\] (\w+_\d+) (?:finished|stopped)",
                              first_output))
  assert done_first, first_output

  second = _sweep(netns, "configs/sweep_digits.yaml", sweep_dir, data_dir)
  output, _ = second.communicate(timeout=400)
  assert second.returncode == 0, first_output[-2000:] + output[-3000:]
  assert "resuming the sweep" in output
  # Trials done before the interruption are kept, not run again.
  started_again = set(re.findall(r"\[sweep\] (\w+_\d+) started", output))
  assert not done_first & started_again, output

  rows = [_ROW.match(l.strip()) for l in output.splitlines()]
  rows = [r for r in rows if r]
  assert [int(r.group(1)) for r in rows] == [1, 2, 3, 4], output
  best = [float(r.group(6)) for r in rows]
  assert best == sorted(best, reverse=True)
  assert best[0] >= 0.95
  assert any(r.group(9) for r in rows), "ASHA stopped no trial early"
  assert any(int(r.group(8)) == TRAIN_STEPS for r in rows)

  space = yaml.safe_load(open(os.path.join(ROOT, "configs",
                                           "sweep_digits.yaml")))
  # Each trial cut off mid-run went on from its checkpoint.
  cut_off = {t for t, step in steps.items() if step >= 200} & started_again
  assert cut_off, (first_output[-2000:], output[-2000:])
  for row in rows:
    model_dir = row.group(10)
    logged = artifacts.hparams(os.path.join(model_dir, "train"))
    assert logged["batch_size"] == int(row.group(3))
    assert logged["optimizer"] == row.group(5)
    assert logged["train_steps"] == TRAIN_STEPS
    assert logged["model"] == space["flags"]["model"]
    with open(os.path.join(model_dir, "trial.log")) as f:
      trial_log = f.read()
    latest = (artifacts.checkpoint_step(model_dir)
              if tf.train.latest_checkpoint(model_dir) else None)
    if row.group(9):
      # ASHA stopped it after an eval: Tune ends the trial's actor, and the
      # run dies with it (PDEATHSIG) at any point, even after its last
      # step but before that step's save (seen: "train step 600/600",
      # latest ckpt-500). No save it logged is lost, and it never reaches
      # the end unless its loop got there before the stop.
      saves = [int(s) for s in re.findall(
          r"(?:Saved checkpoint \S+/ckpt-|checkpoint saved at step )(\d+)",
          trial_log)]
      if saves:
        assert latest is not None and latest >= max(saves), (
            row.group(0), latest, trial_log[-1500:])
      ended = re.search(rf"train step {TRAIN_STEPS}/{TRAIN_STEPS}:",
                        trial_log)
      if not ended:
        assert latest is None or latest < TRAIN_STEPS, row.group(0)
    else:
      assert latest == TRAIN_STEPS, (row.group(0), trial_log[-1500:])
    if row.group(2) in cut_off:
      assert "Resumed from" in trial_log, row.group(2)


def test_a_bad_space_is_one_line_before_ray_starts(tmp_path):
  space = tmp_path / "space.yaml"
  space.write_text("flags: {train_steps: 100}\n"
                   "space: {learning_rate: {loguniform: [0, 0.1]}}\n")
  proc = subprocess.run(
      [sys.executable, "-m", "launch.sweep", f"--space={space}"], cwd=ROOT,
      capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == (
      f"python -m launch.sweep: error: {space}: space.learning_rate: "
      "loguniform needs low > 0. Received: [0, 0.1]")
  assert "Traceback" not in proc.stderr
