"""launch.ray against a real local Ray, started by the launcher inside a
private network namespace with only `lo` up: there Ray falls back to
127.0.0.1, so all its traffic stays on loopback.

Every task is an unchanged `python -m tfdist.train` run by a Ray actor.
"""

import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import artifacts
import test_elastic
from conftest import ROOT
from conftest import LauncherProcess
from conftest import long_test
from conftest import process_alive
from conftest import warm_starts

# Kills processes, times out or owns a daemon: run alone (.ci/run).
pytestmark = pytest.mark.serial

pytest.importorskip("ray", reason="needs the ray extra: pip install "
                    "-e '.[cpu,ray]'")

_ACTOR = re.compile(r"^\[launch\] (\S+) runs in Ray actor pid=(\d+)")
_TASK = re.compile(r"^\[launch\] started (\S+) pid=(\d+)")


def _ray_daemons():
  """pids of Ray's own daemons on this machine."""
  found = set()
  for pid in os.listdir("/proc"):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
    except OSError:
      continue
    if b"raylet" in cmdline or b"gcs_server" in cmdline:
      found.add(int(pid))
  return found


def _pids(output, pattern):
  return {int(m.group(2)) for m in map(pattern.match, output.splitlines())
          if m}


def _launch(netns, launcher_args, train_args):
  return LauncherProcess(launcher_args, train_args, module="launch.ray",
                         prefix=netns)


def _assert_no_task_left(output):
  """No task, actor or waiting spare (the launcher's "warm spares
  waiting" lines) outlives the launcher."""
  started = _pids(output, _ACTOR) | _pids(output, _TASK)
  assert started, output[-2000:]
  started |= {int(p) for line in output.splitlines()
              if "warm spares waiting for a restart's tasks: pids " in line
              for p in line.split("pids ")[1].split(", ") if p}
  deadline = time.monotonic() + 20  # Ray ends killed actors soon after.
  while any(map(process_alive, started)) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not [p for p in started if process_alive(p)], "a task or actor lived on"


def _ray_task_dirs():
  """The scratch directories of Ray tasks in this machine's temp dir, and
  the launcher's, which holds them."""
  return set(glob.glob(os.path.join(tempfile.gettempdir(),
                                    "tfdist-ray-task-*")) +
             glob.glob(os.path.join(tempfile.gettempdir(),
                                    "tfdist-ray-scratch-*")))


def _assert_nothing_left(output, daemons_before):
  _assert_no_task_left(output)
  assert _ray_daemons() <= daemons_before, "Ray's daemons survived"


def test_multi_worker_job_survives_a_killed_actor(netns, tmp_path, data_dir):
  # The restart policy is launch.core's, tested with scripted tasks in CI.
  long_test("about 50 s")
  daemons, scratch_before = _ray_daemons(), _ray_task_dirs()
  model_dir = str(tmp_path / "run")
  run = _launch(netns, ["--workers=2", "--max_restarts=2",
                        "--backoff_seconds=0.2"],
                ["--strategy=multi_worker_mirrored", "--train_steps=1000",
                 "--checkpoint_every=100", "--eval_every=0",
                 f"--model_dir={model_dir}", f"--data_dir={data_dir}"])
  # Early: output comes back through the actor in batches, a little late.
  run.wait_for(lambda l: "worker:1 | " in l and "train step 100/1000" in l)
  output = "".join(run.lines)
  actor = [int(m.group(2)) for m in map(_ACTOR.match, output.splitlines())
           if m and m.group(1) == "worker:1"][-1]
  os.kill(actor, signal.SIGKILL)  # The actor, not the task: it must die too.
  code, output = run.finish(timeout=300)
  assert code == 0, output[-3000:]
  assert "worker:1 exited with code -9; restarting the job" in output
  assert "(attempt 2)" in output
  assert "worker:0 | " in output and "Finished at step 1000/1000" in output
  assert artifacts.checkpoint_step(model_dir) == 1000
  _assert_nothing_left(output, daemons)
  assert _ray_task_dirs() <= scratch_before  # The killed actor's too.


def test_parameter_server_job_ends_at_the_exact_step(netns, tmp_path,
                                                      data_dir):
  """On a tf.data service (--data_workers) whose dispatcher and data
  worker run in actors of their own, gone with the launcher."""
  model_dir = str(tmp_path / "run")
  run = _launch(netns, ["--chief", "--workers=1", "--ps=1",
                        "--data_workers=1"],
                ["--strategy=parameter_server", "--train_steps=300",
                 "--eval_every=0", f"--model_dir={model_dir}",
                 f"--data_dir={data_dir}"])
  code, output = run.finish(timeout=300)
  assert code == 0, output[-3000:]
  assert re.search(r"chief:0 \| Finished at step 300/300 .* eval accuracy "
                   r"0\.9", output), output[-2000:]
  assert "ps:0 | " in output and "worker:0 | " in output
  assert re.search(r"chief:0 \| .*Input: tf.data service grpc://\S+:\d+ "
                   r"\(dynamic\)", output), output[-3000:]
  assert "data_worker:0 | data worker serving" in output
  assert artifacts.checkpoint_step(model_dir) == 300
  served = re.search(r"pids dispatcher=(\d+) data_worker:0=(\d+)", output)
  deadline = time.monotonic() + 20
  while (any(process_alive(int(p)) for p in served.groups())
         and time.monotonic() < deadline):
    time.sleep(0.2)
  assert not [p for p in served.groups() if process_alive(int(p))]


def test_ctrl_c_leaves_no_process(netns, tmp_path, data_dir):
  daemons = _ray_daemons()
  run = _launch(netns, ["--workers=2"],
                ["--strategy=multi_worker_mirrored", "--train_steps=1000000",
                 f"--model_dir={tmp_path / 'run'}", f"--data_dir={data_dir}"])
  run.wait_for(lambda l: "train step 100/" in l)
  run.proc.send_signal(signal.SIGINT)
  code, output = run.finish(timeout=120)
  assert code == 128 + signal.SIGINT, output[-2000:]
  assert "stopped by signal 2" in output
  _assert_nothing_left(output, daemons)


@pytest.mark.parametrize("argv,message", [
    (["--address=127.0.0.1:1", "--workers=1"],
     "no Ray cluster answers at --address=127.0.0.1:1"),
    (["--workers=1", "--cpus_per_task=-1"],
     "--cpus_per_task and --gpus_per_task must be >= 0"),
    (["--workers=0"], "a job needs at least one worker or a chief"),
    (["--workers=2:3", "--", "--batch_size=64"],
     "--workers=2:3 keeps the global batch, which 3 worker(s) cannot split"),
])
def test_bad_input_is_one_line(argv, message):
  if "--" not in argv:
    argv = [*argv, "--"]
  proc = subprocess.run([sys.executable, "-m", "launch.ray", *argv,
                         "--model_dir=unused"], cwd=ROOT, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("python -m launch.ray: error: ") and message in last
  assert "Traceback" not in proc.stderr


def _command(control, name, timeout=120):
  """Asks tests/ray_nodes.py to `name` (add, remove) and waits for it."""
  (control / name).touch()
  deadline = time.monotonic() + timeout
  while not (control / f"{name}.done").exists():
    assert time.monotonic() < deadline, f"ray_nodes.py did not {name}"
    time.sleep(0.2)
  (control / f"{name}.done").unlink()


def test_elastic_job_follows_nodes_joining_and_leaving(netns, tmp_path,
                                                       data_dir):
  """A Ray cluster of one 2-CPU node runs 2 workers; a node that joins
  adds a third, and when that node is gone the job carries on with 2.
  Every membership trains the weights one device would."""
  control = tmp_path / "nodes"
  control.mkdir()
  scratch_before = _ray_task_dirs()
  nodes = subprocess.Popen([*netns, sys.executable, "tests/ray_nodes.py",
                            str(control), "2"], cwd=ROOT,
                           stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 120
    while not (control / "address").exists():
      assert time.monotonic() < deadline and nodes.poll() is None
      time.sleep(0.2)
    model_dir = tmp_path / "run"
    # Room for two changes (about 20 s each) before the last step: the
    # workers train at most about 4 steps/s (tests/paced_worker.py),
    # however fast this CPU is. The model is smooth (test_elastic.COMMON):
    # with the zoo's ReLU MLP, rounding alone (3 replicas against one
    # device) flipped units and the run ended 3.6% of a step's move away.
    steps = 150
    run = _launch(netns, [f"--address={(control / 'address').read_text()}",
                          "--workers=2:3", "--max_restarts=0",
                          "--discovery_seconds=1", "--backoff_seconds=0.2",
                          "--stop_grace_seconds=5",
                          "--module=tests.paced_worker"],
                  [*test_elastic.train_args(model_dir, data_dir, steps),
                   "--strategy=multi_worker_mirrored"])
    run.wait_for(lambda l: l.startswith("worker:0") and "ckpt-20." in l)
    _command(control, "add")
    run.wait_for(lambda l: "membership change: 2 -> 3 workers" in l)
    run.wait_for(lambda l: l.startswith("worker:2") and "train step" in l)
    _command(control, "remove")
    code, output = run.finish()
    assert code == 0, output[-3000:]
    assert "discovery offers 2 worker slot(s): starting with 2" in output
    assert "membership change: 3 -> 2 workers" in output, output[-3000:]
    assert f"worker:0 | Finished at step {steps}/{steps}" in output
    assert artifacts.checkpoint_step(str(model_dir)) == steps
    # Each change handed tasks to warm spares that were waiting (auto:
    # one per task, on the node of the task): on the grown group's first
    # node, and both tasks of the shrunk group.
    warm = warm_starts(output)
    assert warm.get(2, 0) >= 1 and warm.get(3) == 2, (warm, output[-3000:])
    sizes = [v for _, v in artifacts.scalars(
        str(model_dir / "train"), "workers", in_time_order=True)]
    assert sizes == [2, 3, 2]
    test_elastic.assert_one_device_weights(model_dir, tmp_path, data_dir,
                                           steps)
    _assert_no_task_left(output)
    # The tasks of the node that left never cleaned up: their scratch was
    # under the launcher's, which it removed.
    assert _ray_task_dirs() <= scratch_before
  finally:
    (control / "stop").touch()
    try:
      nodes.wait(timeout=60)
    except subprocess.TimeoutExpired:
      nodes.kill()
