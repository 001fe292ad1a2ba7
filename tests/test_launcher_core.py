"""launch.core's restart policy on scripted tasks: real processes that
sleep and exit with given codes, so each race is hit on purpose, in
seconds, without TensorFlow.

Found by a 5-minute PS chaos run: a worker SIGKILLed while the chief was
finishing was restarted after the chief had exited, and then waited for
the chief forever; the launcher waited for that worker.
"""

import argparse
import io
import json
import signal
import socket
import sys
import time

import pytest

from conftest import run_cli
from launch import core
from launch import description

# Races on a timer: run alone (.ci/run).
pytestmark = pytest.mark.serial

SERVE = "import time; time.sleep(600)"


def _exit_after(seconds, code):
  return f"import sys, time; time.sleep({seconds}); sys.exit({code})"


def _launcher(cluster, scripts, *, max_restarts=3, backoff_seconds=0.1,
              discover=None, places_at_most=None):
  """A Launcher whose tasks run the given Python one-liners, and the
  stream its log goes to."""
  args = argparse.Namespace(cluster=cluster, max_restarts=max_restarts,
                            backoff_seconds=backoff_seconds,
                            stop_grace_seconds=5.0)
  out = io.StringIO()

  def make_tasks(attempt_args):
    if places_at_most and attempt_args.cluster.workers > places_at_most:
      raise core.SlotsUnavailable(
          f"could not place {attempt_args.cluster.workers} workers")
    specs = []
    for role, count in attempt_args.cluster.counts().items():
      for index in range(count):
        name = f"{role}:{index}"
        specs.append(description.TaskSpec(
            role=role, index=index, address=f"127.0.0.1:{index}",
            argv=[sys.executable, "-c", scripts[name]], env={}))
    return specs

  return core.Launcher(args, make_tasks=make_tasks, out=out,
                       discover=discover, discover_every_seconds=0.1), out


def _run_with_deadline(launcher, seconds):
  """Runs the launcher in this (main) thread, where it installs its signal
  handlers; SIGALRM fails the test if it hangs. Returns (code, seconds)."""
  def hung(signum, frame):
    raise AssertionError(f"the launcher hung for {seconds}s")
  saved = {s: signal.getsignal(s)
           for s in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM)}
  signal.signal(signal.SIGALRM, hung)
  signal.alarm(seconds)
  start = time.monotonic()
  try:
    return launcher.run(), time.monotonic() - start
  finally:
    signal.alarm(0)
    for signum, handler in saved.items():
      signal.signal(signum, handler)


PS_JOB = description.ClusterDescription(workers=2, chief=True, ps=1)


def test_worker_lost_while_chief_finishes_is_not_restarted():
  # worker:1 dies at 0.5 s; its restart backoff (2 s) outlasts the chief
  # (done at 1.5 s): restarting it then would wait for a chief that is gone.
  launcher, out = _launcher(PS_JOB, {
      "chief:0": _exit_after(1.5, 0), "worker:0": SERVE,
      "worker:1": _exit_after(0.5, 1), "ps:0": SERVE},
      backoff_seconds=2.0)
  code, seconds = _run_with_deadline(launcher, 30)
  log = out.getvalue()
  assert code == 0, log
  assert "restarting it alone in 2.0s" in log
  assert "the chief finished meanwhile; worker:1 is not restarted" in log
  assert log.count("started worker:1") == 1
  # The serving tasks are stopped at once, not after their 600 s sleep.
  assert seconds < 15, log


def test_worker_lost_after_chief_finished_is_not_needed():
  # The evaluator is still at its last eval when worker:1 dies.
  cluster = description.ClusterDescription(workers=2, chief=True, ps=1,
                                           evaluator=True)
  launcher, out = _launcher(cluster, {
      "chief:0": _exit_after(0.5, 0), "worker:0": SERVE,
      "worker:1": _exit_after(1.5, 1), "ps:0": SERVE,
      "evaluator:0": _exit_after(3.0, 0)})
  code, _ = _run_with_deadline(launcher, 30)
  log = out.getvalue()
  assert code == 0, log
  assert ("worker:1 exited with code 1 after the chief finished; it is "
          "not needed any more") in log
  assert log.count("started worker:1") == 1


def test_serving_tasks_failing_after_the_chief_do_not_fail_the_job():
  launcher, out = _launcher(PS_JOB, {
      "chief:0": _exit_after(0.5, 0), "worker:0": _exit_after(1.0, 1),
      "worker:1": _exit_after(1.0, 1), "ps:0": _exit_after(1.0, 1)})
  code, _ = _run_with_deadline(launcher, 30)
  assert code == 0, out.getvalue()
  assert "training finished" in out.getvalue()


def test_multi_worker_job_still_needs_every_worker():
  # Without ps, workers train: one failing restarts the whole job, and
  # with no restarts left its code is the launcher's.
  cluster = description.ClusterDescription(workers=2)
  launcher, out = _launcher(cluster, {
      "worker:0": _exit_after(0.2, 0), "worker:1": _exit_after(0.5, 3)},
      max_restarts=1)
  code, _ = _run_with_deadline(launcher, 30)
  log = out.getvalue()
  assert code == 3, log
  assert "restarting the job" in log and "no restarts left" in log
  assert log.count("started worker:1") == 2


def test_a_taken_port_relaunches_without_using_a_restart(tmp_path):
  # worker:1 finds its port taken on the first attempt only (exit 43).
  marker = tmp_path / "tried"
  flaky = (f"import os, sys; p = {str(marker)!r}; taken = not os.path.exists(p)"
           f"; open(p, 'w').close(); sys.exit(43 if taken else 0)")
  cluster = description.ClusterDescription(workers=2)
  launcher, out = _launcher(cluster, {"worker:0": _exit_after(0.5, 0),
                                      "worker:1": flaky}, max_restarts=0)
  code, _ = _run_with_deadline(launcher, 30)
  log = out.getvalue()
  assert code == 0, log
  assert "worker:1 found its port taken; relaunching with new ports" in log
  assert log.count("started worker:1") == 2


def test_a_preemption_resumes_without_using_a_restart(tmp_path):
  # worker:1 is preempted (saved, exit 42) twice; --max_restarts=0.
  count = tmp_path / "attempts"
  preempted_twice = (
      f"import os, sys; p = {str(count)!r}; n = os.path.getsize(p) if "
      f"os.path.exists(p) else 0; open(p, 'a').write('x'); "
      f"sys.exit(42 if n < 2 else 0)")
  cluster = description.ClusterDescription(workers=2)
  launcher, out = _launcher(cluster, {"worker:0": _exit_after(0.5, 0),
                                      "worker:1": preempted_twice},
                            max_restarts=0)
  code, _ = _run_with_deadline(launcher, 30)
  log = out.getvalue()
  assert code == 0, log
  assert log.count("worker:1 was preempted and saved a checkpoint; resuming "
                   "the job (a preemption uses no restart)") == 2, log
  assert log.count("started worker:1") == 3


def test_a_chief_that_ignores_sigterm_after_the_last_worker_is_killed():
  # Every PS worker is gone; the chief is asked to stop and never does.
  launcher, out = _launcher(PS_JOB, {
      "chief:0": "import signal, time; signal.signal(signal.SIGTERM, "
                 "signal.SIG_IGN); time.sleep(600)",
      "worker:0": _exit_after(0.3, 1), "worker:1": _exit_after(0.3, 1),
      "ps:0": SERVE}, max_restarts=0)
  code, seconds = _run_with_deadline(launcher, 60)
  log = out.getvalue()
  assert code == 1, log
  assert "every worker is gone; asking the chief to checkpoint" in log
  assert "chief:0 did not stop within 5s; SIGKILL" in log
  assert seconds < 30, log


def test_train_exits_43_in_one_line_when_its_port_is_taken(tmp_path):
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    tf_config = {"cluster": {"worker": [f"127.0.0.1:{port}",
                                        f"127.0.0.1:{port + 1}"]},
                 "task": {"type": "worker", "index": 0}}
    model_dir = tmp_path / "run"
    proc = run_cli("--strategy=multi_worker_mirrored",
                   f"--model_dir={model_dir}", check=False, timeout=120,
                   env={"TF_CONFIG": json.dumps(tf_config)})
  assert proc.returncode == 43, proc.stderr
  assert "Traceback" not in proc.stderr + proc.stdout
  errors = [l for l in proc.stderr.splitlines() if l.startswith("tfdist:")]
  assert errors == [f"tfdist: error: could not start this task's gRPC "
                    f"server at 127.0.0.1:{port}: the port is taken (exit "
                    f"code 43: launchers relaunch with new ports)."], \
      proc.stderr


def _offers(*counts):
  """A discovery function that offers `counts` in turn, then the last."""
  offers = list(counts)
  return lambda: offers.pop(0) if len(offers) > 1 else offers[0]


def test_elastic_start_waits_for_min_slots():
  cluster = description.ClusterDescription(workers=3, min_workers=2,
                                           max_workers=3)
  scripts = {f"worker:{i}": _exit_after(0.2, 0) for i in range(3)}
  launcher, out = _launcher(cluster, scripts,
                            discover=_offers(None, None, 1, 2))
  code, _ = _run_with_deadline(launcher, 30)
  log = out.getvalue()
  assert code == 0, log
  assert log.count("discovery gives no answer; waiting for more") == 1
  assert "discovery offers 2 worker slot(s): starting with 2 workers" in log
  assert "started worker:2" not in log


def test_elastic_run_ignores_offers_below_min_and_grows_to_max():
  # Offers 3 at the start (starts 3 of MAX 4), then 1 (below MIN: the
  # group carries on), then 9 (capped at MAX): one change, 3 -> 4.
  cluster = description.ClusterDescription(workers=4, min_workers=2,
                                           max_workers=4)
  scripts = {f"worker:{i}": _exit_after(1.0, 0) for i in range(4)}
  launcher, out = _launcher(cluster, scripts,
                            discover=_offers(3, 1, 1, 9))
  code, _ = _run_with_deadline(launcher, 30)
  log = out.getvalue()
  assert code == 0, log
  changes = [l for l in log.splitlines() if "membership change" in l]
  assert len(changes) == 1 and "3 -> 4 workers" in changes[0], log


def test_elastic_group_that_cannot_be_placed_restarts_one_smaller():
  """Discovery offers 3 slots (Ray may list a node that is gone as alive),
  but only 2 workers can be placed: the group runs with 2 instead of the
  job ending; below MIN the placement error ends it."""
  cluster = description.ClusterDescription(workers=3, min_workers=2,
                                           max_workers=3)
  scripts = {f"worker:{i}": _exit_after(0.2, 0) for i in range(3)}
  launcher, out = _launcher(cluster, scripts, discover=_offers(3),
                            places_at_most=2)
  code, _ = _run_with_deadline(launcher, 30)
  log = out.getvalue()
  assert code == 0, log
  assert ("membership change: 3 -> 2 workers (could not place 3 workers; "
          "trying one fewer)") in log
  assert "started worker:1" in log and "started worker:2" not in log
  launcher, out = _launcher(cluster, scripts, discover=_offers(3),
                            places_at_most=1)
  with pytest.raises(core.SlotsUnavailable, match="could not place 2"):
    _run_with_deadline(launcher, 30)


class _Exited:
  """A process that has exited with `code`; `lost` as launch.ray's
  RemoteProcess says when its actor is gone with its node."""

  def __init__(self, code, lost=False):
    self.code, self.lost = code, lost

  def poll(self):
    return self.code


def test_the_task_lost_with_its_host_is_the_cause_not_its_peers():
  """A peer that only lost a peer (exit 5) gives way to the task whose
  process is gone with its host, which the launcher may learn of only
  after the peers: that one's host is dropped (the Ray failure in CI)."""
  from launch import membership
  from launch import processes
  specs = [description.TaskSpec(role="worker", index=i,
                                address=f"127.0.0.1:{i}", argv=[], env={})
           for i in range(3)]
  job = processes.Job(specs, out=io.StringIO())
  first, gone, other = job.tasks
  first.process, gone.process = _Exited(5), _Exited(-9, lost=True)
  other.process = _Exited(5)
  assert job.cause(first) is gone
  dropped = []
  members = membership.Membership(
      description.ClusterDescription(workers=3, min_workers=2,
                                     max_workers=3),
      discover=lambda: 3, drop_worker=dropped.append, every_seconds=1,
      backoff_seconds=0.1, log=lambda m: None, sleep=lambda s: False)
  members.drop(job.cause(first))
  assert dropped == [gone.spec]
  members.drop(first)  # It only lost a peer: nothing is dropped.
  assert dropped == [gone.spec]
  # A task with an error of its own stays the cause; so does a lost peer
  # when no process was lost.
  first.process = _Exited(1)
  assert job.cause(first) is first
  gone.process.lost = False
  first.process = _Exited(5)
  assert job.cause(first) is first
