"""Randomised faults (tools.chaos) against real jobs: SIGKILL and SIGTERM
to random tasks for 60 s, with a fixed seed; the MultiWorkerMirrored job is
elastic (--workers=1:2, tools.chaos --elastic), so its worker slots also
change at random. The job must end at exactly --train_steps, with an
export that loads and predicts, eval accuracy within 1 point of a
fault-free run, and nothing left behind.

Each case takes 2-3 minutes on 2 cores; both run in the default CI: they
are the headline guarantee.
"""

import io

import pytest

from tools import chaos

# Kills processes, times out or owns a daemon: run alone (.ci/run).
pytestmark = pytest.mark.serial

CASES = {
    "multi_worker_mirrored": (
        ["--workers=1:2"],
        ["--strategy=multi_worker_mirrored", "--train_steps=3000",
         "--checkpoint_every=200", "--eval_every=0", "--log_every=500"]),
    "parameter_server": (
        ["--chief", "--workers=2", "--ps=1", "--evaluator"],
        ["--strategy=parameter_server", "--train_steps=2000",
         "--steps_per_loop=20", "--checkpoint_every=200", "--eval_every=0",
         "--log_every=500"]),
}


@pytest.mark.parametrize("strategy", sorted(CASES))
def test_chaos_loses_nothing(tmp_path, data_dir, strategy):
  launcher, train = CASES[strategy]
  elastic = ["--elastic"] if ":" in launcher[-1] else []
  args = chaos.parse_args([
      "--duration=60", "--kill_every=10-20", "--seed=1", "--baseline",
      *elastic, "--",
      *launcher, "--", *train, f"--data_dir={data_dir}",
      f"--model_dir={tmp_path / 'run'}"])
  out = io.StringIO()
  report = chaos.run_chaos(args, out=out)
  assert len(report["faults"]) >= 3, out.getvalue()
  assert report["lost"] == [], out.getvalue()
  assert report["checkpoint_step"] == args.train_steps
  assert report["export_predicts"] is True
  if elastic:
    assert report["membership_changes"], out.getvalue()
