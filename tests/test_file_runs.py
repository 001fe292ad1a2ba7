"""tfdist.FileData in real runs, from a module outside the repository
(tests/user_files.py as mymod): two MultiWorkerMirrored workers reading
their own files train each example exactly once per epoch across a
SIGTERM and its resume, as one default-strategy process does; default on ram://, mirrored, MultiWorkerMirrored
and parameter servers train on the same streamed files, the synchronous
ones to the same weights; bad FileData is one line."""

import collections
import glob
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

import artifacts
import user_files
from conftest import LauncherProcess
from conftest import user_project
from test_cli_errors import _assert_one_line_error
from test_cli_errors import _tree_digest

USER = ["--model=mymod:build", "--dataset=mymod:data", "--batch_size=32",
        "--steps_per_loop=1", "--eval_every=0", "--export=false",
        "--optimizer=sgd", "--learning_rate=0.1"]


@pytest.fixture
def outside(tmp_path):
  user_files.write(str(tmp_path / "files"))
  return user_project(tmp_path, "user_files.py", "mymod.py")


def _run(cwd, module, args, env):
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd,
                        capture_output=True, text=True, timeout=400,
                        env={**os.environ, **env})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout + proc.stderr


def _ids_in_order(ids_dir):
  """Every id the model logged, in the order each process trained them
  (one process's after another's)."""
  ids = []
  for path in glob.glob(os.path.join(ids_dir, "ids-*.txt")):
    with open(path) as lines:
      ids.extend(int(i) for line in lines for i in line.split())
  return ids


def _logged_ids(ids_dir):
  return collections.Counter(_ids_in_order(ids_dir))


def test_two_workers_train_each_example_once_per_epoch_across_a_sigterm(
    outside, tmp_path):
  """8 files of 64: each worker's epoch is its 4 files, 16 steps of 16."""
  ids_dir = tmp_path / "ids"
  ids_dir.mkdir()
  model_dir = str(tmp_path / "run")
  epochs = 3
  steps = epochs * user_files.NUM_FILES * user_files.PER_FILE // 32
  run = LauncherProcess(
      ["--workers=2", "--max_restarts=0", "--isolate=off"],
      [*USER, "--strategy=multi_worker_mirrored", f"--train_steps={steps}",
       "--log_every=2", "--checkpoint_every=1000", "--cache=off",
       f"--model_dir={model_dir}"],
      env={"USER_FILES": str(tmp_path / "files"),
           "USER_IDS_DIR": str(ids_dir), "USER_SLEEP": "0.05"},
      module="tfdist.launch.local", cwd=outside)
  run.wait_for(lambda l: f"train step 10/{steps}" in l)
  os.kill(run.pids["worker:1"], signal.SIGTERM)
  code, output = run.finish()
  assert code == 0, output[-3000:]
  assert "Input sharding: file: each host reads only its own files" in output
  resumed = int(re.search(r"Resumed from \S+ at step (\d+)", output).group(1))
  assert 10 <= resumed < steps  # Mid-epoch (an epoch is 16 steps).
  assert artifacts.checkpoint_step(model_dir) == steps
  counts = _logged_ids(str(ids_dir))
  everything = range(user_files.NUM_FILES * user_files.PER_FILE)
  assert counts == collections.Counter({i: epochs for i in everything})
  assert "input plan changed" not in output
  # One host now, where two read their own files: the log says the epoch
  # in progress is not exact.
  output = _run(outside, "tfdist.train",
                [*USER, f"--train_steps={steps + 4}", "--cache=off",
                 f"--model_dir={model_dir}"],
                {"USER_FILES": str(tmp_path / "files")})
  assert (f"The input plan changed on resume at step {steps}: sharding "
          "file -> batch, input_pipelines 2 -> 1") in output, output[-3000:]


def test_one_host_trains_each_example_once_per_epoch_across_a_sigterm(
    outside, tmp_path):
  """The default strategy: one process reads all 8 files, an epoch is 16
  steps of 32; SIGTERM at step 10 saves and exits 42, a second process
  resumes there and finishes."""
  ids_dir = tmp_path / "ids"
  ids_dir.mkdir()
  model_dir = str(tmp_path / "run")
  epochs = 2
  steps = epochs * user_files.NUM_FILES * user_files.PER_FILE // 32
  env = {**os.environ, "USER_FILES": str(tmp_path / "files"),
         "USER_IDS_DIR": str(ids_dir), "USER_SLEEP": "0.05"}
  args = [sys.executable, "-m", "tfdist.train", *USER,
          f"--train_steps={steps}", "--log_every=2", "--cache=off",
          "--checkpoint_every=1000", f"--model_dir={model_dir}"]
  first = subprocess.Popen(args, cwd=outside, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  # A run that hangs after its SIGTERM (what this test is for) is killed,
  # and fails below, rather than holding the suite.
  deadline = threading.Timer(300, first.kill)
  deadline.start()
  lines = []
  try:
    for line in first.stdout:
      lines.append(line)
      if f"train step 10/{steps}" in line:
        first.send_signal(signal.SIGTERM)
  finally:
    deadline.cancel()
    first.stdout.close()
  assert first.wait(timeout=120) == 42, "".join(lines[-40:])
  output = _run(outside, "tfdist.train", args[3:], env)
  # The counts the first run kept: the resume counts no file again.
  assert re.search(r"train: 512 records in 8 file\(s\); 0 file\(s\) "
                   r"counted in \S+ s, 8 known", output), output[-3000:]
  resumed = int(re.search(r"Resumed from \S+ at step (\d+)", output).group(1))
  assert 10 <= resumed < 16, output[-3000:]  # Inside the first epoch.
  assert artifacts.checkpoint_step(model_dir) == steps
  counts = _logged_ids(str(ids_dir))
  everything = range(user_files.NUM_FILES * user_files.PER_FILE)
  assert counts == collections.Counter({i: epochs for i in everything})


def test_every_strategy_trains_on_the_streamed_files(outside, tmp_path):
  """Streamed (--cache=off) and read by every host (batch sharding), the
  synchronous strategies see the single device's batches, augmented
  alike (draws keyed by the place in the stream), with --seed=0 (a seed
  of 0 once made every shuffle fail to trace)."""
  local = {"USER_FILES": str(tmp_path / "files")}
  common = [*USER, "--dataset=mymod:jittered", "--seed=0",
            "--train_steps=24", "--log_every=12",
            "--checkpoint_every=0", "--cache=off", "--input_sharding=batch"]
  dirs = {name: str(tmp_path / name) for name in
          ("default", "mirrored", "mwms", "ps")}
  output = _run(outside, "tfdist.train",
                [*common, "--strategy=default",
                 f"--model_dir={dirs['default']}"],
                {"USER_FILES": "ram://tfdist-user-files"})
  assert "streamed from its files, not cached" in output
  _run(outside, "tfdist.train",
       [*common, "--strategy=mirrored", "--num_cpu_devices=2",
        f"--model_dir={dirs['mirrored']}"], local)
  evals = {"default": _final_eval(output)}
  output = _run(outside, "tfdist.launch.local",
                ["--workers=2", "--", *common,
                 "--strategy=multi_worker_mirrored",
                 f"--model_dir={dirs['mwms']}"], local)
  # The eval files, read by file (each worker its own), evaluate what
  # one process does.
  assert "each of the 2 hosts reads only its own eval files" in output
  evals["mwms"] = _final_eval(output)
  output = _run(outside, "tfdist.launch.local",
                ["--chief", "--workers=2", "--ps=1", "--", *common,
                 "--strategy=parameter_server",
                 f"--model_dir={dirs['ps']}"], local)
  assert "streamed from its files, not cached" in output
  assert ("each of the 2 parameter-server workers reads all the train "
          "data, in an order of its own") in output
  for name, model_dir in dirs.items():
    assert artifacts.checkpoint_step(model_dir) == 24, name
  expected = artifacts.model_weights(dirs["default"])
  for name in ("mirrored", "mwms"):
    artifacts.assert_weights_close(artifacts.model_weights(dirs[name]),
                                   expected, rtol=1e-5)
  assert evals["mwms"][1] == evals["default"][1], evals
  assert evals["mwms"][0] == pytest.approx(evals["default"][0], abs=1e-4)


def _final_eval(output):
  """({metric: value}, examples) of the last eval line."""
  line = re.findall(r"eval  step \d+: (.*)  \((\d+) examples\)", output)[-1]
  return ({name: float(value) for name, value in
           re.findall(r"(\w+) (-?[0-9.]+)", line[0])}, int(line[1]))


def test_two_workers_read_their_own_files_of_a_hand_built_pipeline(
    outside, tmp_path):
  """A TFRecordDataset(files).map(parse) of the user's own on 2
  MultiWorkerMirrored workers: TF's auto-shard rewrite deals the 8 files
  out, worker w reads files w, w + 2, ... (16 steps: an epoch of each
  worker's 256 records in batches of 16), each record once."""
  ids_dir = tmp_path / "ids"
  ids_dir.mkdir()
  output = _run(outside, "tfdist.launch.local", [
      "--workers=2", "--isolate=off", "--", *USER,
      "--dataset=mymod:hand_built", "--strategy=multi_worker_mirrored",
      "--train_steps=16", f"--model_dir={tmp_path / 'run'}"],
      {"USER_FILES": str(tmp_path / "files"), "USER_IDS_DIR": str(ids_dir)})
  assert "Input sharding: file: each host reads only its own files of " \
         "this hand-built pipeline" in output, output[-3000:]
  workers = []
  for path in sorted(glob.glob(str(ids_dir / "ids-*.txt"))):
    with open(path) as lines:
      workers.append([int(i) for line in lines for i in line.split()])
  assert sorted(map(len, workers)) == [256, 256]
  files = sorted(_files_of(ids) for ids in workers)
  assert files == [{0, 2, 4, 6}, {1, 3, 5, 7}], files
  assert all(len(set(ids)) == 256 for ids in workers)


def _worker_batches(path):
  """{worker index: [batch ids, ...]} from the lines workers printed."""
  batches = collections.defaultdict(list)
  with open(path) as lines:
    for line in lines:
      worker, ids = re.fullmatch(r"(\d+) \[([\d ]+)\]\n", line).groups()
      batches[int(worker)].append([int(i) for i in ids.split()])
  return batches


def _files_of(ids):
  return {i // user_files.PER_FILE for i in ids}


def test_parameter_server_workers_read_their_own_files(outside, tmp_path):
  """8 files on 2 asynchronous workers: each reads only its 4 files of
  the run's plan in an epoch (8 steps of 32), and a resume at step 16
  starts each in its next epoch's files."""
  from tfdist.data import order
  printed = tmp_path / "worker-ids.txt"
  common = ["--chief", "--workers=2", "--ps=1", "--", *USER, "--seed=3",
            "--strategy=parameter_server", "--cache=off",
            "--checkpoint_every=16", f"--model_dir={tmp_path / 'run'}"]
  env = {"USER_FILES": str(tmp_path / "files"),
         "USER_WORKER_IDS": str(printed)}
  output = _run(outside, "tfdist.launch.local",
                [*common, "--train_steps=16"], env)
  assert "Input sharding: file: each host reads only its own files" in output
  for epoch in (0, 1):
    batches = _worker_batches(printed)
    assert sum(map(len, batches.values())) == 16, batches
    for worker in range(2):
      mine = [i for batch in batches[worker][:8] for i in batch]
      assert len(set(mine)) == len(mine), (epoch, worker)
      assert _files_of(mine) <= set(order.host_files(
          user_files.NUM_FILES, 3, epoch, 2, worker)), (epoch, worker)
    printed.unlink()
    if not epoch:
      _run(outside, "tfdist.launch.local", [*common, "--train_steps=32"],
           env)


def test_workers_that_see_other_files_stop_in_one_line(outside, tmp_path):
  model_dir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "tfdist.launch.local", "--workers=2", "--",
       *USER, "--dataset=mymod:one_file_short", "--train_steps=4",
       "--strategy=multi_worker_mirrored", f"--model_dir={model_dir}"],
      cwd=outside, capture_output=True, text=True, timeout=300,
      env={**os.environ, "USER_FILES": str(tmp_path / "files")})
  output = proc.stdout + proc.stderr
  assert proc.returncode != 0, output[-3000:]
  assert "the workers do not see the same data files: worker:1 sees 9 " \
         "file(s) of 488 records" in output, output[-3000:]
  assert "Traceback" not in output, output[-3000:]
  assert not glob.glob(str(model_dir / "ckpt-*"))


@pytest.mark.parametrize("function,expected", [
    ("bad_pattern", "no train file matches '/nonexistent/tfdist/train-*'"),
    ("bad_parse", "parse failed on a train record: InvalidArgumentError")])
def test_bad_file_data_is_one_line_and_leaves_model_dir(outside, tmp_path,
                                                        function, expected):
  model_dir = outside / "kept"
  model_dir.mkdir()
  (model_dir / "ckpt-7.index").write_bytes(b"not really a checkpoint")
  before = _tree_digest(str(model_dir))
  proc = subprocess.run(
      [sys.executable, "-m", "tfdist.train", "--model=mymod:build",
       f"--dataset=mymod:{function}", f"--model_dir={model_dir}"],
      cwd=outside, capture_output=True, text=True, timeout=300,
      env={**os.environ, "USER_FILES": str(tmp_path / "files")})
  _assert_one_line_error(proc, expected)
  assert _tree_digest(str(model_dir)) == before
