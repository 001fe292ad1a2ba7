"""Train input on the tf.data service, with TF's own dispatcher and data
workers as real processes (launch.local --data_workers), from a module
outside the repository (tests/user_files.py as mymod): with dynamic
sharding and 2 data workers an epoch trains each example id exactly once
on one trainer and on 2 MultiWorkerMirrored trainers (which end at
exactly --train_steps); parameter servers train on it; a data worker
killed, the dispatcher restarted and a trainer preempted each leave the
run finishing at exactly --train_steps, logged, with a fresh job after
the resume; a run resumed twice in an epoch reads the epoch its stream
is in; a bad address, a dispatcher that is down and a pipeline that
calls Python are one line each."""

import collections
import os
import re
import signal
import subprocess
import sys
import time

import portpicker
import pytest

import artifacts
import user_files
from conftest import LauncherProcess
from conftest import user_project
from test_cli_errors import _assert_one_line_error
from test_file_runs import USER
from test_file_runs import _ids_in_order
from test_file_runs import _logged_ids

EPOCH_STEPS = user_files.NUM_FILES * user_files.PER_FILE // 32  # 16


@pytest.fixture
def outside(tmp_path):
  user_files.write(str(tmp_path / "files"))
  project = user_project(tmp_path, "user_files.py", "mymod.py")
  yield project
  # A test that failed midway leaves no launcher (its tasks and service
  # die with it).
  for run in _RUNS:
    if run.proc.poll() is None:
      run.proc.kill()
      run.proc.wait()
  _RUNS.clear()


_RUNS = []


def _served_run(outside, tmp_path, launcher_args, train_args, sleep="0"):
  ids_dir = tmp_path / "ids"
  ids_dir.mkdir(exist_ok=True)
  model_dir = str(tmp_path / "run")
  run = LauncherProcess(
      ["--isolate=off", *launcher_args],
      [*USER, "--eval_every=0", "--checkpoint_every=1000", "--log_every=4",
       f"--model_dir={model_dir}", *train_args],
      env={"USER_FILES": str(tmp_path / "files"),
           "USER_IDS_DIR": str(ids_dir), "USER_SLEEP": sleep},
      module="tfdist.launch.local", cwd=outside)
  _RUNS.append(run)
  return run, model_dir, str(ids_dir)


def _every_id(times):
  return collections.Counter(
      {i: times for i in range(user_files.NUM_FILES * user_files.PER_FILE)})


@pytest.mark.parametrize("trainers", [1, 2])
def test_an_epoch_on_two_data_workers_trains_each_example_once(
    outside, tmp_path, trainers):
  """Dynamic sharding: each slice of the epoch goes to one data worker;
  2 MultiWorkerMirrored trainers read in round-robin and stop together."""
  strategy = "multi_worker_mirrored" if trainers == 2 else "default"
  run, model_dir, ids_dir = _served_run(
      outside, tmp_path, [f"--workers={trainers}", "--data_workers=2",
                          "--max_restarts=0"],
      [f"--strategy={strategy}", f"--train_steps={EPOCH_STEPS}"])
  code, output = run.finish(timeout=300)
  assert code == 0, output[-3000:]
  assert "a dispatcher and 2 data workers" in output
  assert re.search(r"Input: tf.data service grpc://127.0.0.1:\d+ \(dynamic\)"
                   rf", job tfdist-\w+-\w+-s0-b32", output), output[-3000:]
  assert artifacts.checkpoint_step(model_dir) == EPOCH_STEPS
  # Once each, but for what a data worker a unit ahead delivers of the
  # next epoch before the other ends this one (seen in CI on a loaded
  # machine): at most one unit (2 of the 8 files) twice, as many not yet.
  counts = _logged_ids(ids_dir)
  twice = [i for i, count in counts.items() if count == 2]
  assert sum(counts.values()) == sum(_every_id(1).values())
  assert max(counts.values()) <= 2 and len(twice) <= 2 * user_files.PER_FILE
  assert len(counts) == len(_every_id(1)) - len(twice), counts


def test_parameter_servers_train_on_the_service(outside, tmp_path):
  run, model_dir, ids_dir = _served_run(
      outside, tmp_path, ["--workers=2", "--ps=1", "--chief",
                          "--data_workers=2", "--max_restarts=0"],
      ["--strategy=parameter_server", f"--train_steps={EPOCH_STEPS}"])
  code, output = run.finish(timeout=300)
  assert code == 0, output[-3000:]
  assert re.search(r"chief:0 \| .*Input: tf.data service \S+ \(dynamic\), "
                   r"job tfdist-\w+-\w+-s0-b32\.", output), output[-3000:]
  assert artifacts.checkpoint_step(model_dir) == EPOCH_STEPS
  # Every step trained on served batches of the files' examples. (Read
  # first come, first served, later epochs' units start before this one's
  # are used up: an epoch's steps are not its examples exactly once.)
  counts = _logged_ids(ids_dir)
  assert sum(counts.values()) == EPOCH_STEPS * 32
  assert set(counts) <= set(_every_id(1))


def _pid_of(output, name):
  found = re.findall(rf"{re.escape(name)}=(\d+)", output)
  return int(found[-1])


@pytest.mark.serial
def test_faults_of_the_service_and_a_preempted_trainer(outside, tmp_path):
  """Two MultiWorkerMirrored trainers reading in round-robin: a data
  worker SIGKILLed (its replacement serves), then the dispatcher, then a
  trainer preempted. The run ends at exactly --train_steps and the
  resumed trainers read a fresh job, named for their resume step."""
  # At least 0.1 s a step: room for two restarts (a TF import each).
  steps = 12 * EPOCH_STEPS
  run, model_dir, _ = _served_run(
      outside, tmp_path, ["--workers=2", "--data_workers=2",
                          "--max_restarts=1"],
      ["--strategy=multi_worker_mirrored", f"--train_steps={steps}",
       "--checkpoint_every=16"], sleep="0.1")
  run.wait_for(lambda l: f"train step 20/{steps}" in l)
  head = "".join(run.lines)
  os.kill(_pid_of(head, "data_worker:0"), signal.SIGKILL)
  run.wait_for(lambda l: l.startswith("[launch] tf.data service: "
                                      "data_worker:0 ") and
               "the replacement joins the running job" in l)
  os.kill(_pid_of(head, "dispatcher"), signal.SIGKILL)
  run.wait_for(lambda l: l.startswith("[launch] tf.data service: "
                                      "dispatcher ") and
               "restarting it from its work_dir" in l)
  back = set()
  run.wait_for(lambda l: back.update(
      name for name in ("data_worker:0 | data worker serving",
                        "dispatcher | dispatcher listening")
      if l.startswith(name)) or len(back) == 2)
  run.wait_for(lambda l: "train step " in l)  # Training goes on.
  os.kill(run.pids["worker:0"], signal.SIGTERM)
  code, output = run.finish(timeout=400)
  assert code == 0, output[-4000:]
  assert artifacts.checkpoint_step(model_dir) == steps
  resumed = int(re.search(r"Resumed from \S+ at step (\d+)", output).group(1))
  assert 20 < resumed < steps
  # Both trainers of an attempt read one job; the resumed attempt another.
  jobs = set(re.findall(r"worker:\d \| .*job (tfdist-\w+-\w+-s(\d+)-b32)",
                        output))
  assert sorted(int(step) for _, step in jobs) == [0, resumed], jobs
  for name in ("data_worker:0", "dispatcher"):
    faults = [l for l in output.splitlines()
              if l.startswith(f"[launch] tf.data service: {name} ")]
    assert len(faults) == 1, faults


@pytest.fixture
def one_data_worker(tmp_path):
  """A dispatcher and one data worker, started as a user would by hand:
  with one data worker the stream's order is the same in every job."""
  port = portpicker.pick_unused_port()
  started = [subprocess.Popen(
      [sys.executable, "-m", "tfdist.launch.data_service", *args],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for args in (["dispatcher", f"--port={port}",
                           f"--work_dir={tmp_path / 'journal'}"],
                          ["worker", f"--dispatcher=127.0.0.1:{port}"])]
  yield f"grpc://127.0.0.1:{port}"
  for proc in started:
    proc.kill()
    proc.wait()


def test_a_second_resume_in_an_epoch_reads_the_epoch_the_stream_is_in(
    outside, tmp_path, one_data_worker):
  """Stopped at step 8, half way through epoch 0, the resumed run reads
  epoch 0 again from its start: at step 20 the step count is in epoch 1
  but the stream is 3/4 through epoch 0. The next resume must read epoch
  0 again (the lag the checkpoint keeps), not skip its last quarter."""
  model_dir, reads = tmp_path / "run", []
  for steps in (8, 20, 20 + EPOCH_STEPS):
    ids_dir = tmp_path / f"ids-{steps}"
    ids_dir.mkdir()
    proc = _train([f"--data_service={one_data_worker}",
                   "--data_service_wait=120", f"--train_steps={steps}",
                   "--checkpoint_every=1000", f"--model_dir={model_dir}"],
                  outside, timeout=300,
                  env={"USER_FILES": str(tmp_path / "files"),
                       "USER_IDS_DIR": str(ids_dir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reads.append(_ids_in_order(ids_dir))
  first, second, third = reads
  assert [len(r) for r in reads] == [8 * 32, 12 * 32, EPOCH_STEPS * 32]
  assert second[:len(first)] == first  # Epoch 0 again, from its start.
  assert third[:len(second)] == second  # Still epoch 0: not skipped.
  assert collections.Counter(third) == _every_id(1)
  assert "reads that epoch again from its start" in proc.stderr
  assert "stream is 1.2 epochs behind the step count" in proc.stderr


def _train(args, cwd, env=None, timeout=120):
  return subprocess.run(
      [sys.executable, "-m", "tfdist.train", *USER, "--train_steps=4",
       *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
      env={**os.environ, **(env or {})})


@pytest.mark.parametrize("address,expected", [
    ("nonsense", "--data_service takes grpc://HOST:PORT. Received: "
     "--data_service=nonsense"),
    ("grpc://127.0.0.1:{free}", "no tf.data dispatcher answers there "
     "(Connection refused) after 2 s"),
])
def test_a_bad_or_silent_address_is_one_line(outside, tmp_path, address,
                                             expected):
  address = address.format(free=portpicker.pick_unused_port())
  model_dir = tmp_path / "never"
  start = time.monotonic()
  proc = _train([f"--data_service={address}", "--data_service_wait=2",
                 f"--model_dir={model_dir}"],
                outside, env={"USER_FILES": str(tmp_path / "files")})
  _assert_one_line_error(proc, expected)
  assert time.monotonic() - start < 60
  assert not model_dir.exists()


def test_a_pipeline_that_calls_python_is_one_line(outside, tmp_path):
  run, model_dir, _ = _served_run(
      outside, tmp_path, ["--workers=1", "--data_workers=1",
                          "--max_restarts=0"],
      ["--dataset=mymod:python_parse", "--train_steps=4"])
  code, output = run.finish(timeout=200)
  assert code != 0
  assert "Traceback" not in output
  errors = [l for l in output.splitlines() if "tfdist: error:" in l]
  assert len(errors) == 1, output[-3000:]
  assert "calls Python (tf.py_function or tf.numpy_function)" in errors[0]
  assert not os.path.exists(os.path.join(model_dir, "checkpoint"))


def test_tensorboard_shows_the_input_wait_per_step(tmp_path, monkeypatch):
  """A step's wait for its batch is measured in the train loop: about the
  4 ms per example a slow augment sleeps, and a small part of a step on
  fast input, on any CPU."""
  import tfdist  # pylint: disable=g-import-not-at-top
  files = tmp_path / "files"
  user_files.write(str(files))
  monkeypatch.setenv(user_files.FILES_ENV, str(files))
  model_dir = tmp_path / "slow"
  tfdist.train(model="user_files:build", dataset="user_files:slow_augment",
               model_dir=str(model_dir), train_steps=12, log_every=4,
               batch_size=32, steps_per_loop=1, eval_every=0, export=False,
               cache="off")
  waits = [wait for _, wait in artifacts.scalars(model_dir / "train",
                                                 "input_wait_ms")]
  assert len(waits) == 3, waits
  # 32 examples of 4 ms each: at least 16 ms a step even if the augment
  # ran on 8 threads at once.
  assert min(waits[1:]) > 16, waits
  # Fast input (digits in memory) waits for a small part of a step: the
  # wait does not count the step itself, even on one core, where TF's one
  # inter-op thread could run the step before the second stamp.
  fast = tmp_path / "fast"
  proc = subprocess.run(
      ["taskset", "-c", "0", sys.executable, "-m", "tfdist.train",
       "--model=mlp_wide", f"--model_dir={fast}", "--train_steps=30",
       "--log_every=10", "--batch_size=256", "--steps_per_loop=1",
       "--eval_every=0", "--export=false"], capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  waits = dict(artifacts.scalars(fast / "train", "input_wait_ms"))
  rates = dict(artifacts.scalars(fast / "train", "steps_per_sec"))
  for step in (20, 30):
    assert waits[step] < 0.3 * 1000 / rates[step], (waits, rates)


def test_a_job_no_trainer_reads_is_collected():
  """Each resume registers a new dynamic-sharding job; TF's dispatcher
  keeps such jobs, and their pipelines on the data workers, unless told
  to collect them: launch.data_service's dispatcher is. TF's own servers,
  in this process, with a 1 s timeout."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from launch import data_service as launch_service  # pylint: disable=g-import-not-at-top
  service = tf.data.experimental.service
  dispatcher = service.DispatchServer(launch_service.dispatcher_config(
      port=0, work_dir="", job_gc_timeout_ms=1000))
  worker = service.WorkerServer(service.WorkerConfig(
      dispatcher_address=dispatcher.target.split("://")[1],
      heartbeat_interval_ms=200))
  source = tf.data.Dataset.range(10**9)
  dataset_id = service.register_dataset(dispatcher.target, source)
  served = service.from_dataset_id(
      service.ShardingPolicy.DYNAMIC, dispatcher.target, dataset_id,
      element_spec=source.element_spec, job_name="resumed-at-0")
  iterator = iter(served)
  next(iterator)
  assert worker._num_tasks() == 1  # pylint: disable=protected-access
  del iterator, served  # The trainer moved on to a new job.
  deadline = time.time() + 30
  while worker._num_tasks() and time.time() < deadline:  # pylint: disable=protected-access
    time.sleep(0.2)
  assert worker._num_tasks() == 0  # pylint: disable=protected-access
  worker.stop()
  dispatcher.stop()


def _served_ids(dataset, count, data_workers):
  """Label ids of `count` served examples of `dataset`, on TF's own
  dispatcher and data workers in this process (ShardingPolicy.DYNAMIC,
  as a run's), and whether each example's features match its label."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.data import service_units  # pylint: disable=g-import-not-at-top
  service = tf.data.experimental.service
  dispatcher = service.DispatchServer()
  workers = [service.WorkerServer(service.WorkerConfig(
      dispatcher_address=dispatcher.target.split("://")[1],
      heartbeat_interval_ms=200)) for _ in range(data_workers)]
  batches = service_units.served_batches(
      dataset, mode="dynamic", seed=0, first_unit=0, batch_size=10,
      buffer=16)
  dataset_id = service.register_dataset(dispatcher.target, batches)
  served = service.from_dataset_id(
      service.ShardingPolicy.DYNAMIC, dispatcher.target, dataset_id,
      element_spec=batches.element_spec, job_name="ids")
  ids, matched = [], True
  for features, labels in served.take(count // 10):
    ids.extend(int(i) for i in labels.numpy())
    matched &= bool(tf.reduce_all(features[:, 0] == tf.cast(
        labels, tf.float32) * 10))
  for worker in workers:
    worker.stop()
  dispatcher.stop()
  return ids, matched


def test_a_pipeline_of_your_own_is_split_at_its_source():
  """range(n).map(heavy) once cost its whole map in each of an epoch's 4
  units: now the dispatcher splits the range among the data workers. One
  data worker serves each example once per epoch; two run apart by up to
  what each holds, never more than an epoch. A zip of two sources cannot
  be split apart (its sides would pair other workers' splits): it is cut
  in units, its pairs intact. A range of 300 is served in chunks of 4
  (tfdist.data.chunked_range)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist import data  # pylint: disable=g-import-not-at-top
  from tfdist.data import service_units  # pylint: disable=g-import-not-at-top

  def example(i):
    return tf.cast(i, tf.float32)[None] * 10, i
  numbers = tf.data.Dataset.range(300)
  own = data.from_user("own", numbers.map(example), numbers.map(example))
  zipped_source = tf.data.Dataset.zip(numbers.map(lambda i: example(i)[0]),
                                      numbers)
  zipped = data.from_user("zipped", zipped_source, zipped_source)
  assert service_units.by_source(own) and not service_units.by_source(zipped)
  # Served without tfdist's cache of data in memory: a cache on a data
  # worker would keep its first epoch's splits for good.
  from tfdist.data import sources  # pylint: disable=g-import-not-at-top
  served = service_units.served_batches(own, mode="dynamic", seed=0,
                                        first_unit=0, batch_size=10,
                                        buffer=16)
  assert "CacheDatasetV2" not in sources._graph_ops(served)  # pylint: disable=protected-access
  assert "FlatMapDataset" in sources._graph_ops(served)  # pylint: disable=protected-access
  ids, matched = _served_ids(own, 600, data_workers=1)
  assert matched and collections.Counter(ids) == {i: 2 for i in range(300)}
  for dataset in (own, zipped):
    ids, matched = _served_ids(dataset, 900, data_workers=2)
    counts = collections.Counter(ids)
    assert matched and set(counts) == set(range(300)), counts
    assert set(counts.values()) <= {2, 3, 4}, counts
