"""The launchers' supervision of the tf.data service's processes
(launch.data_service.DataService), with real processes that stand in for
the dispatcher and the data workers (no TensorFlow): a data worker that
never starts fails the launch in seconds, not after the 5-minute wait;
once the job runs, losing the dispatcher or the last data worker for good
stops the job (its trainers would wait for ever), also when a
replacement cannot even be started."""

import subprocess
import sys
import threading
import time

import pytest

from launch import data_service

LISTENS = f"print('{data_service.LISTENING} 1', flush=True)"
SERVES = f"print('{data_service.SERVING} here', flush=True)"


def _python(code):
  return [sys.executable, "-c", code]


def _start(_, argv, env):
  return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)


class _Supervised:
  """A DataService over `commands`, its lines and its give-ups kept."""

  def __init__(self, commands, start_process=_start):
    self.lines, self.gave_up = [], threading.Event()
    self.service = data_service.DataService(
        commands_by_name=commands, start_process=start_process,
        log=self.lines.append, write=lambda name, line: None,
        restart_seconds=0.01, on_give_up=self.gave_up.set)

  def __enter__(self):
    return self

  def __exit__(self, *_):
    self.service.close()


def test_a_data_worker_that_never_starts_fails_the_launch_at_once():
  with _Supervised({"dispatcher": _python(LISTENS + "; import time; time.sleep(120)"),
                    "data_worker:0": _python("raise SystemExit(3)")}) as run:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"data_worker:0 ended 5 times"):
      run.service.start(timeout=120)
    assert time.monotonic() - started < 60
    assert not run.gave_up.is_set()  # No job to stop yet.


def test_a_dispatcher_lost_for_good_stops_the_job(tmp_path):
  # Its first run serves for 3 s; each replacement ends at once.
  marker = tmp_path / "started"
  dispatcher = _python(
      "import os, sys, time\n"
      f"first = not os.path.exists({str(marker)!r})\n"
      f"open({str(marker)!r}, 'a').close()\n"
      f"{LISTENS}\n"
      "time.sleep(3 if first else 0)\n"
      "sys.exit(1)")
  with _Supervised({"dispatcher": dispatcher,
                    "data_worker:0": _python(SERVES + "; import time; time.sleep(120)")}) as run:
    run.service.start(timeout=120)
    assert run.gave_up.wait(60), run.lines
    assert sum("restarting it from its work_dir" in l
               for l in run.lines) == data_service.MAX_QUICK_FAILURES - 1
    assert "not restarted again; stopping the job" in run.lines[-1]


def test_a_data_worker_that_cannot_be_started_again_is_given_up():
  """A replacement whose start raises (its host or Ray node is lost) is a
  failed start: the restarts go on, then the last data worker is given
  up and the job stopped, instead of the restart thread dying."""
  starts = []

  def start_process(name, argv, env):
    starts.append(name)
    if name == "data_worker:0" and starts.count(name) > 1:
      raise RuntimeError("node lost")
    return _start(name, argv, env)
  with _Supervised({"dispatcher": _python(LISTENS + "; import time; time.sleep(120)"),
                    "data_worker:0": _python(
                        SERVES + "; import time; time.sleep(5)")},
                   start_process=start_process) as run:
    run.service.start(timeout=120)
    assert run.gave_up.wait(60), run.lines
  assert starts.count("data_worker:0") == data_service.MAX_QUICK_FAILURES
  assert any("could not be started again (node lost)" in l
             for l in run.lines), run.lines
  assert "stopping the job" in run.lines[-1]
