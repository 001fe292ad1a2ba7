"""In-process unit tests: config validation, auto strategy choice, the
global-batch invariant of the input pipeline, and the model zoo."""

import math
import os
import subprocess
import sys
import tempfile
import types

import numpy as np
import pytest
import tensorflow as tf

from conftest import ROOT
from conftest import process_alive
from tfdist import models
from tfdist import cluster
from tfdist import config as config_lib
from tfdist import data
from tfdist import preflight
from tfdist import strategies
from tfdist.errors import ConfigError


def test_config_rejects_bad_values_naming_them():
  with pytest.raises(ConfigError, match="Received: batch_size=0"):
    config_lib.Config(model_dir="/tmp/x", batch_size=0)
  with pytest.raises(ConfigError, match="Unrecognized strategy: 'warp'"):
    config_lib.Config(model_dir="/tmp/x", strategy="warp")
  with pytest.raises(ConfigError, match="profile_steps=5,5"):
    config_lib.Config(model_dir="/tmp/x", profile_steps=(5, 5))
  with pytest.raises(ConfigError, match="model_dir is required"):
    config_lib.Config(model_dir="")
  with pytest.raises(TypeError):
    config_lib.Config("/tmp/x")  # Keyword-only.


def test_config_is_frozen():
  config = config_lib.Config(model_dir="/tmp/x")
  with pytest.raises(AttributeError):
    config.batch_size = 3


@pytest.mark.parametrize("tf_config,gpus,cpus,expected", [
    ({"cluster": {"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]},
      "task": {"type": "chief", "index": 0}}, 0, 1, "parameter_server"),
    ({"cluster": {"worker": ["a:1", "b:1"]},
      "task": {"type": "worker", "index": 1}}, 0, 1, "multi_worker_mirrored"),
    ({"cluster": {"worker": ["a:1"]},
      "task": {"type": "worker", "index": 0}}, 0, 1, "default"),
    (None, 2, 1, "mirrored"),
    (None, 1, 1, "one_device"),
    (None, 0, 4, "mirrored"),
    (None, 0, 1, "default"),
])
def test_auto_choice(tf_config, gpus, cpus, expected):
  task = cluster.parse_tf_config(tf_config) if tf_config else None
  name, reason = strategies.choose_auto(tf_config=task, num_gpus=gpus,
                                        num_cpu_devices=cpus)
  assert name == expected and reason


def _numbers_dataset(n=100):
  return data.Dataset(
      name="numbers", input_shape=(1,), num_classes=2,
      num_train_examples=n, num_test_examples=37,
      train_source=lambda: tf.data.Dataset.range(n).map(
          lambda i: (tf.cast(tf.reshape(i, [1]), tf.float32),
                     tf.cast(i % 2, tf.int32))),
      test_source=lambda: tf.data.Dataset.range(37).map(
          lambda i: (tf.cast(tf.reshape(i, [1]), tf.float32),
                     tf.cast(i % 2, tf.int32))))


def _global_batches(input_fn, hosts, replicas, steps):
  """Reassembles global batches from every host's per-replica batches."""
  per_host_replicas = replicas // hosts
  streams = []
  for host in range(hosts):
    context = tf.distribute.InputContext(num_input_pipelines=hosts,
                                         input_pipeline_id=host,
                                         num_replicas_in_sync=replicas)
    batches = list(input_fn(context).take(steps * per_host_replicas))
    streams.append(batches)
  result = []
  for step in range(steps):
    parts = [b[0].numpy().ravel() for host in range(hosts) for b in
             streams[host][step * per_host_replicas:
                           (step + 1) * per_host_replicas]]
    result.append(np.concatenate(parts))
  return result


@pytest.mark.parametrize("hosts,replicas", [(1, 2), (1, 4), (2, 2), (2, 4)])
def test_global_batches_do_not_depend_on_topology(hosts, replicas):
  dataset = _numbers_dataset()
  fn = lambda start: data.train_input_fn(  # noqa: E731
      dataset, global_batch_size=16, seed=3, start_step=start)
  single = _global_batches(fn(0), 1, 1, 8)
  # Batches cross the epoch boundary (100 examples) and every epoch is a
  # fresh permutation.
  assert sorted(np.concatenate(single)[:100]) == list(range(100))
  assert not np.array_equal(np.concatenate(single)[:16],
                            np.concatenate(single)[100:116])
  split = _global_batches(fn(0), hosts, replicas, 8)
  for a, b in zip(single, split):
    np.testing.assert_array_equal(a, b)
  resumed = _global_batches(fn(5), hosts, replicas, 3)
  for a, b in zip(single[5:], resumed, strict=True):
    np.testing.assert_array_equal(a, b)


def test_train_stream_says_it_never_ends():
  # So a multi-worker iterator skips its per-step end-of-data all-reduce,
  # and one CPU replica per process can use a plain iterator (the file
  # mode: tests/test_input_sharding.py).
  fn = data.train_input_fn(_numbers_dataset(), global_batch_size=16, seed=3)
  assert fn(tf.distribute.InputContext()).cardinality() == (
      tf.data.INFINITE_CARDINALITY)


def test_plain_input_only_for_one_cpu_replica_of_a_mirrored_strategy(
    two_cpu_strategy):
  from tfdist import runners  # pylint: disable=g-import-not-at-top
  context = runners.plain_input_context(
      tf.distribute.MirroredStrategy(["/cpu:0"]))
  assert (context.num_input_pipelines, context.input_pipeline_id,
          context.num_replicas_in_sync) == (1, 0, 1)
  # Several local replicas, or no mirrored strategy: TF's iterator.
  assert runners.plain_input_context(two_cpu_strategy) is None
  assert runners.plain_input_context(tf.distribute.get_strategy()) is None
  assert runners.plain_input_context(
      tf.distribute.OneDeviceStrategy("/cpu:0")) is None


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_eval_counts_each_example_once(replicas):
  dataset = _numbers_dataset()
  steps = data.eval_steps(dataset, global_batch_size=8)
  assert steps == 5
  context = tf.distribute.InputContext(num_replicas_in_sync=replicas)
  seen, weight = [], 0.0
  for images, _, weights in data.eval_input_fn(
      dataset, global_batch_size=8)(context).take(steps * replicas):
    seen.extend(images.numpy().ravel()[weights.numpy() > 0])
    weight += weights.numpy().sum()
  assert sorted(seen) == list(range(37)) and weight == 37


@pytest.mark.parametrize("name", models.names())
def test_models_build_and_predict(name):
  model = models.build(name, input_shape=(8, 8, 1), num_classes=10)
  logits = model(tf.zeros([3, 8, 8, 1]), training=False)
  assert logits.shape == (3, 10) and logits.dtype == tf.float32


def test_unknown_model_lists_valid_names():
  with pytest.raises(ConfigError, match="Valid: mlp, mlp_wide, cnn"):
    models.build("nope", input_shape=(8, 8, 1), num_classes=10)


@pytest.mark.parametrize("replicas,workers,devices,expected", [
    (1, 1, ["/device:CPU:0"], "step"),
    # MWMS on CPUs: XLA has no CPU collectives, so the all-reduce stays
    # outside the compiled forward and backward (it used to crash).
    (2, 2, ["/device:CPU:0"], "forward"),
    (2, 2, ["/device:GPU:0"], "step"),
    (4, 1, ["/device:GPU:0", "/device:GPU:1"], "forward"),
])
def test_jit_mode_keeps_cpu_collectives_out_of_xla(replicas, workers,
                                                   devices, expected):
  info = strategies.StrategyInfo(
      strategy=types.SimpleNamespace(num_replicas_in_sync=replicas),
      name="multi_worker_mirrored", reason="test", num_workers=workers)
  config = config_lib.Config(model_dir="unused", jit_compile=True)
  assert preflight.jit_mode(config, info, devices) == expected


def test_jit_mode_refuses_several_logical_cpus():
  info = strategies.StrategyInfo(
      strategy=types.SimpleNamespace(num_replicas_in_sync=2),
      name="mirrored", reason="test")
  config = config_lib.Config(model_dir="unused", jit_compile=True)
  with pytest.raises(ConfigError, match="Received: jit_compile=True with 2 "
                     "local CPU replicas"):
    preflight.jit_mode(config, info, ["/device:CPU:0", "/device:CPU:1"])


def test_eval_counts_exactly_beyond_float32():
  """float32 counts stop at 2**24 (16.7M examples); the eval sums are
  float64, in the step and in the packed vector the replicas reduce."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfdist import compiled_loops  # pylint: disable=g-import-not-at-top
  from tfdist import loop_wire  # pylint: disable=g-import-not-at-top
  from tfdist import task as task_lib  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
  task = task_lib.Task()
  metrics = compiled_loops.Metrics(
      [keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
  loops = compiled_loops.LoopFunctions(
      strategy=tf.distribute.get_strategy(), model=model,
      optimizer=keras.optimizers.SGD(0.1), task=task, metrics=metrics,
      global_batch_size=4, steps_per_loop=2,
      global_step=tf.Variable(0, dtype=tf.int64))
  big = 2.0**24
  state = loop_wire.EvalState(
      tf.constant(big, tf.float64), tf.constant(big, tf.float64),
      metrics.zeros())
  batch = (tf.zeros([4, 2]), tf.zeros([4], tf.int32),
           tf.constant([1.0, 0.0, 0.0, 0.0]))
  state = loops.eval_step(batch, state)
  sums = loops.wire.unpack_eval(loops.wire.pack_eval(state).numpy(), 1)
  assert sums.examples == big + 1  # float32 would give 2**24.
  assert sums.stop is False


def test_ray_worker_slots_count_live_nodes_beside_other_tasks():
  ray = pytest.importorskip("launch.ray")
  nodes = [{"NodeID": "a", "Alive": True, "Resources": {"CPU": 2.5}},
           {"NodeID": "b", "Alive": True, "Resources": {"CPU": 1.0}},
           {"NodeID": "c", "Alive": False, "Resources": {"CPU": 8.0}}]
  def slots(**kw):
    return ray.worker_slots(nodes, **{"cpus_per_task": 1.0,
                                      "gpus_per_task": 0.0,
                                      "other_tasks": 0, **kw})
  assert slots() == 3
  assert slots(other_tasks=1) == 2  # A chief takes one.
  assert slots(left_out={"b"}) == 2
  assert slots(gpus_per_task=1.0) == 0  # No node has a GPU.
  assert slots(cpus_per_task=0.0) is None
  # A shared cluster: another job holds 1.5 of the 3.5 CPUs; this job's
  # own group holds 1 bundle (not free, but its own).
  assert slots(available={"CPU": 1.0}, held=1) == 2
  assert slots(available={"CPU": 0.5}, held=0) == 0
  assert slots(available={"CPU": 8.0}, held=2) == 3  # Nodes bound it.


def test_ssh_worker_hosts_follow_discovery_above_min(tmp_path):
  from launch import description
  from launch import ssh_hosts
  offer = tmp_path / "hosts"
  said = []
  hosts = ssh_hosts.WorkerHosts(["a"], command=f"cat {offer}",
                                min_workers=2, log=said.append)
  assert hosts.take(1) == ["a"]
  offer.write_text("h1:2\nh2:1\n")
  assert hosts.discover() == 3 and hosts.take(3) == ["h1", "h1", "h2"]
  offer.write_text("h1:1\n")
  assert hosts.discover() == 1  # Below MIN: the hosts stay.
  assert hosts.take(3) == ["h1", "h1", "h2"]
  # The worker on h2 is dropped: a slot of h2 goes, whatever its index
  # (a discovery may have reordered the slots since the attempt began).
  hosts.drop(description.TaskSpec(role="worker", index=0,
                                  address="h2:2222", argv=[], env={}))
  assert hosts.take(2) == ["h1", "h1"]
  with pytest.raises(ValueError, match="3 workers need 3 worker slots"):
    hosts.take(3)
  offer.write_text("h1 2\n")
  assert hosts.discover() is None and "not host:slots" in said[-1]


def test_ssh_discovery_keeps_a_failed_slot_out_for_a_while(tmp_path):
  """A script that still lists h2 after its worker failed: the slot
  stays out for 120 s, then 240 s after a second failure, so the group
  does not grow back onto a broken host at every look."""
  from launch import description
  from launch import ssh_hosts
  offer, now, said = tmp_path / "hosts", [0.0], []
  offer.write_text("h1:2\nh2:1\n")
  hosts = ssh_hosts.WorkerHosts([], command=f"cat {offer}",
                                min_workers=2, log=said.append,
                                clock=lambda: now[0])
  failed = description.TaskSpec(role="worker", index=2, address="h2:2222",
                                 argv=[], env={})
  assert hosts.discover() == 3
  hosts.drop(failed)
  assert hosts.discover() == 2 and hosts.take(2) == ["h1", "h1"]
  assert said[-1] == ("discovery offers h2 again, where a worker failed: 1 "
                      "of its slot(s) kept out for 120s more.")
  hosts.discover()
  assert len(said) == 1  # Said once per drop.
  now[0] = 121.0
  assert hosts.discover() == 3 and hosts.take(3) == ["h1", "h1", "h2"]
  hosts.drop(failed)
  now[0] = 121.0 + 239.0
  assert hosts.discover() == 2
  now[0] = 121.0 + 241.0
  assert hosts.discover() == 3


def test_flat_layout_round_trips_in_tf_and_numpy():
  from tfdist import flat_layout  # pylint: disable=g-import-not-at-top
  shapes = [(2, 3), (4,), (), (1, 1, 2)]
  arrays = [np.arange(np.prod(s), dtype=np.float32).reshape(s) + 10 * i
            for i, s in enumerate(shapes)]
  layout = flat_layout.FlatLayout(shapes)
  assert layout.sizes == [6, 4, 1, 2] and layout.size == 13
  flat = layout.flatten([tf.constant(a) for a in arrays], tf.float16)
  assert flat.dtype == tf.float16 and flat.shape == (13,)
  np.testing.assert_array_equal(flat.numpy().astype(np.float32),
                                np.concatenate([a.ravel() for a in arrays]))
  back = layout.unflatten(flat, [tf.float32] * 4)
  for got, want in zip(back, arrays):
    assert got.dtype == tf.float32
    np.testing.assert_array_equal(got.numpy(), want)
  flat_np = layout.flatten_numpy(arrays)
  for got, want in zip(layout.unflatten_numpy(flat_np), arrays):
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_a_plot_without_matplotlib_is_one_line_before_any_run():
  import importlib.util  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec("matplotlib"):
    pytest.skip("matplotlib is installed (the 'plots' extra)")
  proc = subprocess.run(
      [sys.executable, "-m", "tools.bench_shard_memory", "--plot=x.png"],
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
      capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2
  assert proc.stderr == ("tfdist: error: plots need matplotlib: pip install "
                         "-e '.[plots]'\n")


class _Killed(BaseException):
  """Stands for a SIGKILL: nothing after it runs, no cleanup either."""


@pytest.mark.parametrize("root", ["local", "ram://tfdist-replace"])
def test_a_replace_cut_short_anywhere_is_finished_whole(tmp_path,
                                                        monkeypatch, root):
  """replace_tree is cut before each of its renames and removals in turn
  (the export's replace, on a local disk and ram://). After
  finish_replace the target is whole: the new tree, or, when the cut
  came before the replace began, the old one with the new one still
  staged. Then nothing else is left beside it."""
  from tfdist import storage  # pylint: disable=g-import-not-at-top
  base = str(tmp_path) if root == "local" else f"{root}/{tmp_path.name}"
  old = {"saved_model.pb": "old", "variables/variables.index": "o1",
         "assets/a.txt": "o2"}
  new = {"saved_model.pb": "new", "variables/variables.index": "n1",
         "variables/variables.data-00000-of-00001": "n2"}

  def write(tree, files):
    for name, text in files.items():
      tf.io.gfile.makedirs(storage.join(tree, name).rpartition("/")[0])
      with tf.io.gfile.GFile(storage.join(tree, name), "w") as f:
        f.write(text)

  def read(tree):
    found = {}
    for directory, _, files in tf.io.gfile.walk(tree):
      for name in files:
        path = storage.join(directory, name)
        with tf.io.gfile.GFile(path) as f:
          found[path[len(tree) + 1:]] = f.read()
    return found

  real = {name: getattr(tf.io.gfile, name)
          for name in ("rename", "remove", "rmtree")}
  for cut in range(1, 40):
    target = storage.join(base, f"cut{cut}", "export")
    staging = storage.staging_path(target)
    write(target, old)
    write(staging, new)
    calls = []

    def cut_before(name):
      def call(*args, **kwargs):
        calls.append(name)
        if len(calls) == cut:
          raise _Killed()
        return real[name](*args, **kwargs)
      return call

    for name in real:
      monkeypatch.setattr(tf.io.gfile, name, cut_before(name))
    try:
      storage.replace_tree(staging, target)
      finished = True
    except _Killed:
      finished = False
    for name, function in real.items():
      monkeypatch.setattr(tf.io.gfile, name, function)
    storage.finish_replace(target)
    if read(target) == old:  # Cut before it began: nothing was lost,
      assert read(staging) == new, cut  # and the next export redoes it.
      storage.replace_tree(staging, target)
    assert read(target) == new, cut
    assert not tf.io.gfile.exists(staging)
    assert [name.rstrip("/") for name in tf.io.gfile.listdir(
        storage.join(base, f"cut{cut}"))] == ["export"], cut
    if finished:
      break
  assert finished and cut > 8  # Every step of the replace was cut once.


def test_replica_check_takes_the_same_nan_for_agreement(two_cpu_strategy):
  """Identical NaN replicas agree (the NaN-loss check names the step);
  a NaN on one replica only, or another value, is divergence."""
  from tfdist import replica_check  # pylint: disable=g-import-not-at-top
  strategy = two_cpu_strategy
  with strategy.scope():
    variable = tf.Variable([1.0, float("nan")], name="w")
  checker = replica_check.ReplicaChecker(
      strategy=strategy, variables=[variable], replicas_per_worker=2)
  checker.check(1)  # Both replicas hold [1, nan].
  variable.values[1].assign([1.0, 2.0])
  with pytest.raises(replica_check.ReplicaDivergenceError,
                     match="replica 1"):
    checker.check(2)


def _stall_watch(timeout_seconds):
  import io
  import threading
  from tfdist import stall_watch
  exits, err = [], io.StringIO()
  fired = threading.Event()

  def exit_fn(code):
    exits.append(code)
    fired.set()

  watch = stall_watch.StallWatch(timeout_seconds=timeout_seconds,
                                 message="a peer stopped answering",
                                 err=err, exit_fn=exit_fn)
  return watch, exits, err, fired


def test_stall_watch_ends_a_call_that_runs_past_its_usual_length():
  """A call of a known key that runs `timeout` past its usual length ends
  the task with the lost-peer line and code, before TF's own timeout."""
  from tfdist import stall_watch
  from tfdist.errors import PEER_LOST_EXIT_CODE
  watch, exits, err, fired = _stall_watch(0.2)
  with watch.watching("train"):  # The first call (it traces) is unwatched.
    pass
  assert watch.usual_seconds("train") is not None
  with watch.watching("train"):
    assert fired.wait(timeout=30)
  assert exits == [PEER_LOST_EXIT_CODE]
  assert err.getvalue() == "tfdist: error: a peer stopped answering\n"
  assert stall_watch.tf_backstop_seconds(5.0) == 10.0
  assert stall_watch.tf_backstop_seconds(0.0) is None


def test_stall_watch_lets_calls_of_usual_length_and_first_calls_run(
    caplog):
  import time
  # The runners' keys: (kind, what makes the traced call differ...).
  first_eval, other_eval, train = ("eval", 10), ("eval", 12), (
      "train", False, 10)
  watch, exits, _, _ = _stall_watch(0.3)
  with watch.watching(first_eval):
    time.sleep(1.5)  # A first call, longer than the timeout: no deadline.
  # Usual: 1.5 s; a call may take twice that before it counts as stalled.
  assert watch.deadline_seconds(first_eval) == pytest.approx(3.0, abs=0.3)
  with watch.watching(first_eval):
    time.sleep(2.4)  # Past usual + timeout (1.8 s), within twice usual.
  with watch.watching(train):  # Another key has its own first call.
    time.sleep(0.4)
  for seconds in (1.5, 2.4):  # Another eval key, as long.
    with watch.watching(other_eval):
      time.sleep(seconds)
  time.sleep(1.0)  # Any timer left armed would have fired by now.
  assert exits == []
  # Calls longer than the timeout, where TF's own may act first: said
  # once for eval calls, whatever their key, and not for train.
  said = [r.getMessage() for r in caplog.records]
  assert len(said) == 1 and said[0].startswith("eval calls take 2."), said
  assert "longer than --collective_timeout=0.3: " in said[0], said
  with pytest.raises(ValueError, match="timeout_seconds=0"):
    from tfdist import stall_watch
    stall_watch.StallWatch(timeout_seconds=0, message="x")


def test_a_collective_failing_outside_a_loop_call_is_a_lost_peer():
  """The callbacks' agreement, the restore's broadcast or a sharded save
  that loses a peer exits 5 (a lost peer), never as this task's error."""
  from tfdist import runners
  from tfdist.errors import PEER_LOST_EXIT_CODE
  lost = tf.errors.UnavailableError(
      None, None, "Collective ops is aborted by: Socket closed")
  with pytest.raises(runners.PeerError, match=(
      r"a collective on worker:1 outside a loop call lost a peer: .*"
      r"Peers: chief:0 \(127.0.0.1:1\)\.")) as raised:
    with runners.peer_losses_named("worker:1", ("chief:0 (127.0.0.1:1)",)):
      raise lost
  assert raised.value.exit_code == PEER_LOST_EXIT_CODE
  # Not a collective's failure (a remote file system), or no peers: as is.
  remote = tf.errors.UnavailableError(None, None, "gs://b/x: 503")
  with pytest.raises(tf.errors.UnavailableError):
    with runners.peer_losses_named("worker:1", ("chief:0 (127.0.0.1:1)",)):
      raise remote
  with pytest.raises(tf.errors.UnavailableError):
    with runners.peer_losses_named("local", ()):
      raise lost


def test_a_best_checkpoint_removed_before_it_is_kept_is_written(tmp_path):
  """A sidecar evaluates behind the training run: --keep_checkpoints may
  remove the checkpoint it evaluated before it is kept as the best. The
  best then holds the weights the sidecar restored from it, and its index
  never names files that are not there (a flaky CI failure)."""
  from tfdist import checkpoints
  weights = tf.Variable([1.0, 2.0])
  model_dir = str(tmp_path)
  store = checkpoints.CheckpointStore(
      objects={"weights": weights}, model_dir=model_dir,
      write_dir=model_dir, keep=1,
      signature={"model": "m", "num_classes": 1, "variables": {}})
  evaluated = store.save(10)
  weights.assign([3.0, 4.0])
  store.save(20)  # keep=1: the run removes ckpt-10.
  assert not tf.io.gfile.exists(f"{evaluated}.index")
  weights.assign([1.0, 2.0])  # What the sidecar restored from ckpt-10.
  kept = store.keep_best(evaluated, {"step": 10})
  restored = tf.Variable([0.0, 0.0])
  reading = tf.train.Checkpoint(weights=restored).read(kept)
  reading.assert_existing_objects_matched()
  np.testing.assert_array_equal(restored.numpy(), [1.0, 2.0])
  assert tf.train.latest_checkpoint(os.path.dirname(kept)) == kept


@pytest.mark.parametrize("killed", ["best.json", "checkpoint"])
def test_a_kill_while_the_best_is_kept_leaves_one_best(tmp_path,
                                                       monkeypatch, killed):
  """keep_best writes best.json and the best's `checkpoint` index: a kill
  at either write leaves a best whose state (its step) and checkpoint
  agree, once the next run reads it back."""
  from tfdist import checkpoints
  from tfdist import storage
  weights = tf.Variable([1.0])
  model_dir = str(tmp_path)

  def store():
    return checkpoints.CheckpointStore(
        objects={"weights": weights}, model_dir=model_dir,
        write_dir=model_dir, keep=3,
        signature={"model": "m", "num_classes": 1, "variables": {}})
  first = store()
  first.keep_best(first.save(10), {"step": 10})
  later = first.save(20)
  write_text = storage.write_text

  def killed_at(path, text):
    if path.endswith(f"/{killed}"):
      raise KeyboardInterrupt  # The process ends here.
    write_text(path, text)
  monkeypatch.setattr(storage, "write_text", killed_at)
  with pytest.raises(KeyboardInterrupt):
    first.keep_best(later, {"step": 20})
  monkeypatch.setattr(storage, "write_text", write_text)
  state = store().read_best_state(mend=True)
  best = tf.train.latest_checkpoint(f"{model_dir}/best_checkpoint")
  assert best.endswith(f"ckpt-{state['step']}"), (best, state)
  reading = tf.train.Checkpoint(weights=tf.Variable([0.0])).read(best)
  reading.assert_existing_objects_matched()


def test_a_kill_during_the_best_export_leaves_it_marked(tmp_path):
  """The best's export is marked pending in best.json before it starts:
  a kill during it leaves the mark (for the resume), a finished one
  clears it."""
  from tfdist import best
  from tfdist import checkpoints
  from tfdist import evaluation
  weights, model_dir = tf.Variable([1.0]), str(tmp_path)
  store = checkpoints.CheckpointStore(
      objects={"weights": weights}, model_dir=model_dir, write_dir=model_dir,
      keep=3, signature={"model": "m", "num_classes": 1, "variables": {}})
  exports = []

  def export_fn(best):
    exports.append(best)
    if len(exports) == 1:
      raise KeyboardInterrupt  # The process ends in the first export.
  keeper = evaluation.BestKeeper(
      tracker=best.BestTracker(metric="loss", mode="min"),
      checkpoints=store, export_fn=export_fn)
  with pytest.raises(KeyboardInterrupt):
    keeper.update(10, {"loss": 1.0}, checkpoint_fn=lambda: store.save(10))
  assert store.read_best_state()["export_pending_at_step"] == 10
  resumed = evaluation.BestKeeper(
      tracker=best.BestTracker(metric="loss", mode="min"),
      checkpoints=store, export_fn=export_fn)
  resumed.load()
  assert resumed.tracker.export_pending_at == 10
  resumed.finish_export()
  assert exports == [True, True]
  assert store.read_best_state()["export_pending_at_step"] is None
  resumed.finish_export()  # Nothing pending: nothing written again.
  assert exports == [True, True]


def test_optional_state_restores_when_the_checkpoint_holds_it(tmp_path):
  """The input's position (the served stream's lag) is saved with each
  checkpoint; a checkpoint written before it was kept still restores."""
  from tfdist import checkpoints
  signature = {"model": "m", "num_classes": 1, "variables": {}}

  def store(model_dir, optional):
    weights = tf.Variable([0.0])
    return weights, checkpoints.CheckpointStore(
        objects={"weights": weights}, optional=optional,
        model_dir=str(model_dir), write_dir=str(model_dir), keep=2,
        signature=signature)
  weights, without = store(tmp_path / "old", {})
  weights.assign([5.0])
  without.save(3)
  lag = tf.Variable(7, dtype=tf.int64)
  weights, with_lag = store(tmp_path / "old", {"lag": lag})
  assert with_lag.restore().endswith("ckpt-3")
  assert weights.numpy()[0] == 5.0 and int(lag.numpy()) == 7
  lag.assign(96)
  with_lag.save(4)
  lag.assign(0)
  weights, again = store(tmp_path / "old", {"lag": lag})
  assert again.restore().endswith("ckpt-4")
  assert int(lag.numpy()) == 96
  # A run without it restores the checkpoint that has it.
  weights, plain = store(tmp_path / "old", {})
  assert plain.restore().endswith("ckpt-4") and weights.numpy()[0] == 5.0


def _survivor_store(model_dir, weights, step):
  from tfdist import checkpoints
  return checkpoints.CheckpointStore(
      objects={"weights": weights, "step": step},
      model_dir=model_dir, write_dir=model_dir, keep=3,
      signature={"model": "m", "num_classes": 1, "variables": {}})


def test_a_survivor_keeps_its_last_ended_call_not_the_live_state(tmp_path):
  """A loop call a lost peer aborted may have applied part of its
  updates: the survivor writes the state of the call before, which the
  next group restores ahead of an older checkpoint."""
  from tfdist import survivor
  model_dir = str(tmp_path)
  weights, step = tf.Variable([1.0, 2.0]), tf.Variable(0, dtype=tf.int64)
  store = _survivor_store(model_dir, weights, step)
  state = survivor.SurvivorState(
      variables=[weights, step], step_variable=step,
      write=lambda n: store.write_survivor("worker:1", n),
      task_name="worker:1")
  assert state.keep() is None  # No call ended yet: the last checkpoint.
  step.assign(5)
  store.save(5)
  weights.assign([3.0, 4.0])
  step.assign(10)
  state.commit(10)
  weights.assign([99.0, 99.0])  # Half of an aborted call's updates.
  path = state.keep()
  assert path == f"{model_dir}/survivors/worker-1/ckpt-10"
  np.testing.assert_array_equal(weights.numpy(), [3.0, 4.0])
  fresh_weights, fresh_step = tf.Variable([0.0, 0.0]), tf.Variable(
      0, dtype=tf.int64)
  fresh = _survivor_store(model_dir, fresh_weights, fresh_step)
  assert fresh.restore() == path
  assert fresh.is_survivor_state(path)
  # A model_dir that is itself under a "survivors" directory holds
  # checkpoints that are no survivor's.
  inside = _survivor_store(f"{model_dir}/survivors/run", fresh_weights,
                           fresh_step)
  assert not inside.is_survivor_state(f"{model_dir}/survivors/run/ckpt-5")
  assert not inside.is_survivor_state(None)
  np.testing.assert_array_equal(fresh_weights.numpy(), [3.0, 4.0])
  assert int(fresh_step.numpy()) == 10
  fresh.remove_survivor_states()
  assert not tf.io.gfile.exists(f"{model_dir}/survivors")


def test_a_survivor_state_older_than_the_last_checkpoint_is_ignored(
    tmp_path):
  model_dir = str(tmp_path)
  weights, step = tf.Variable([1.0]), tf.Variable(3, dtype=tf.int64)
  store = _survivor_store(model_dir, weights, step)
  store.write_survivor("worker:0", 3)
  weights.assign([2.0])
  latest = store.save(8)
  weights.assign([0.0])
  assert store.restore() == latest
  np.testing.assert_array_equal(weights.numpy(), [2.0])


def test_spares_hand_a_task_its_order_and_refuse_other_commands():
  """launch.spare.Spares with `cat` for a spare process: the order it
  writes comes back as it would reach launch.spare's stdin."""
  import json
  import subprocess
  import sys
  from launch import spare
  started = []
  def start_cat(argv, env):
    started.append((argv, env))
    return subprocess.Popen(["cat"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
  spares = spare.Spares(command=[sys.executable, "-m", "launch.spare"],
                        count=1, start_process=start_cat)
  assert spares.take([sys.executable, "-m", "tfdist.train"], {}) is None
  spares.start({"SHARED": "1"})
  assert started == [([sys.executable, "-m", "launch.spare"],
                      {"SHARED": "1"})]
  assert spares.take(["/other/python", "-m", "tfdist.train"], {}) is None
  assert spares.take([sys.executable, "tool.py"], {}) is None
  # TF's native logs are read at the import the spare did quietly.
  for asks in (["--native_logs"], ["--native_logs=1"], ["--verbosity=1"],
               ["-v", "2"]):
    assert spares.take([sys.executable, "-m", "tfdist.train", *asks],
                       {}) is None, asks
  process = spares.take([sys.executable, "-m", "tfdist.train", "--x=1",
                         "--nonative_logs", "--verbosity=0"],
                        {"TF_CONFIG": "{}"})
  order = json.loads(process.stdout.read())
  process.wait()
  assert order == {"module": "tfdist.train",
                   "args": ["--x=1", "--nonative_logs", "--verbosity=0"],
                   "env": {"TF_CONFIG": "{}"}, "remote": False}
  assert len(started) == 2  # A new spare waits in its place.
  waiting = spares.pids
  spares.close()
  assert waiting and not any(process_alive(pid) for pid in waiting)
  with pytest.raises(ValueError, match="count must be >= 0. Received: -1"):
    spare.Spares(command=[], count=-1, start_process=start_cat)


def test_spares_per_task_and_none_for_native_logs():
  """--spares: auto is one per task when the job can restart; a job whose
  tasks ask for TF's native logs keeps none (they start cold)."""
  import argparse
  import types
  from launch import spare
  parser = argparse.ArgumentParser()
  spare.add_argument(parser)

  def count(spares, train_args=(), restarts=1, elastic=False):
    args = parser.parse_args([f"--spares={spares}"])
    args.train_args, args.max_restarts = list(train_args), restarts
    args.cluster = types.SimpleNamespace(elastic=elastic)
    return spare.count_from(parser, args)
  assert (count("auto"), count("auto", restarts=0),
          count("auto", restarts=0, elastic=True), count("2")) == (1, 0, 1, 2)
  assert count("auto", ["--native_logs"]) == 0
  assert count("2", ["-v", "1"]) == 0


def test_a_served_resume_starts_the_epoch_its_stream_is_in():
  """1000 examples an epoch (4 units), global batch 10. Resumed at step
  90, the stream reads epoch 0 again and runs 900 behind; resumed again
  at step 210, the stream is 200 into epoch 1 (the step count is in epoch
  2): epoch 1 is read again, none of it skipped."""
  from tfdist.data import service_units
  dataset = types.SimpleNamespace(file_split=None, num_train_examples=1000,
                                  in_memory=True, name="d",
                                  train_pipeline=None)
  assert service_units.resume_point(dataset, trained=0, lag=0) == (0, 0)
  assert service_units.resume_point(dataset, trained=900, lag=0) == (0, 900)
  assert service_units.resume_point(dataset, trained=2100, lag=900) == (
      4, 1100)
  # A lag kept at a larger batch: never before the first example.
  assert service_units.resume_point(dataset, trained=100, lag=900) == (
      0, 100)
  # Unknown size: the stream starts again, and runs behind by it all.
  unknown = types.SimpleNamespace(file_split=None, num_train_examples=None,
                                  in_memory=False, name="d",
                                  train_pipeline=None)
  assert service_units.resume_point(unknown, trained=640, lag=0) == (0, 640)
  # Split at its source: a unit is an epoch.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  numbers = tf.data.Dataset.range(1000)
  split = types.SimpleNamespace(file_split=None, num_train_examples=1000,
                                in_memory=True, name="d",
                                train_pipeline=lambda: numbers)
  assert service_units.resume_point(split, trained=2100, lag=900) == (
      1, 1100)


def test_preparing_digits_leaves_no_temporary_directory(tmp_path):
  """tfds leaves an empty directory in TMPDIR for each dataset it has not
  prepared yet; a fresh data_dir must not leave one each time."""
  temp = tmp_path / "tmp"
  temp.mkdir()
  subprocess.run([sys.executable, "-c", "import sys; from tfdist import "
                  "digits; digits.prepare(sys.argv[1])",
                  str(tmp_path / "data")], cwd=ROOT, check=True,
                 capture_output=True, env={**os.environ, "TMPDIR": str(temp)})
  assert (tmp_path / "data").exists() and not list(temp.iterdir())


def test_leftovers_names_what_the_tests_left_and_nothing_else():
  """.ci/run's last check: a tfdist namespace, or a process of the run
  (one that inherited the run's mark), that was not there before is an
  error; one that was, or the check's own, is not; and so is a new
  temporary directory of ours."""
  from tools import leftovers
  before = {"namespaces": ["tfdist-1", "other"],
            "processes": {"10": "python -m tfdist.train --a"},
            "temp": ["tfdist-worker1-old"]}
  now = {"namespaces": ["tfdist-1", "other", "tfdist-2", "mine"],
         "processes": {"10": "python -m tfdist.train --a",
                       "12": "python -m launch.local --workers=2",
                       "13": "python -m tools.leftovers check f",
                       "14": "python tests/ray_nodes.py dir 2"},
         "temp": ["tfdist-worker1-old", "tfdist-ray-task-x", "tmpab12tfds",
                  "unrelated"]}
  errors = leftovers.left_behind(before, now, mine={"13"})
  assert errors == ["network namespace tfdist-2",
                    "process 12: python -m launch.local --workers=2",
                    "process 14: python tests/ray_nodes.py dir 2"] + [
                        f"temporary directory {tempfile.gettempdir()}/{name}"
                        for name in ("tfdist-ray-task-x", "tmpab12tfds")]
  # Only processes that inherited the mark are the run's.
  marked = subprocess.Popen(["sleep", "30"],
                            env={**os.environ, leftovers.MARK: "probe-1"})
  unmarked = subprocess.Popen(["sleep", "30"])
  try:
    assert str(marked.pid) in leftovers.snapshot("probe-1")["processes"]
    assert str(unmarked.pid) not in leftovers.snapshot("probe-1")[
        "processes"]
  finally:
    for proc in (marked, unmarked):
      proc.kill()
      proc.wait()


@pytest.mark.parametrize("piece_bytes", [12, 40, 1 << 20])
def test_the_chiefs_state_goes_in_pieces_and_back_whole(two_cpu_strategy,
                                                        piece_bytes):
  """ChiefBroadcast sends the state in pieces of at most PIECE_BYTES (a
  variable over several, several in one), one dtype at a time: every
  value comes back to its own place. Mirrored replicas hold the same
  values, so nothing differs and nothing changes."""
  from tfdist import replica_check
  with two_cpu_strategy.scope():
    state = [tf.Variable(tf.reshape(tf.range(n, dtype=tf.float32) + n,
                                    [n // 2, 2])) for n in (2, 10, 6, 40)]
    state += [tf.Variable(7, dtype=tf.int64), tf.Variable([1.5],
                                                          tf.float64)]
    state.insert(2, tf.Variable(tf.zeros([0, 3])))  # Nothing to send.
  expected = [v.numpy().copy() for v in state]
  broadcast = replica_check.ChiefBroadcast(strategy=two_cpu_strategy,
                                           variables=state)
  broadcast.PIECE_BYTES = piece_bytes
  # Each variable with values comes back once, whole, in its own place.
  floats = [v for v in state if v.dtype == tf.float32]
  back = list(broadcast._received(tf.float32, floats))  # pylint: disable=protected-access
  assert [id(v) for v, _, _ in back] == [id(v) for v in floats
                                         if v.shape.num_elements()]
  for variable, own, chiefs in back:
    np.testing.assert_array_equal(own, variable.numpy().reshape([-1]))
    np.testing.assert_array_equal(chiefs.reshape(variable.shape),
                                  variable.numpy())
  assert broadcast.run() == []
  for variable, values in zip(state, expected):
    np.testing.assert_array_equal(variable.numpy(), values)

def test_a_stop_holds_only_at_the_step_whose_eval_decided_it():
  """A resume stops without training only at the step whose eval
  decided the stop (best.json's early_stopped_at_step, a variable every
  worker gets): a resume from an older checkpoint trains on."""
  from tfdist import best
  tracker = best.BestTracker(metric="loss", mode="min", patience=1)
  assert not tracker.stopped_at_step(10) and tracker.stopped_at is None
  tracker.update(10, {"loss": 1.0})
  assert tracker.update(20, {"loss": 1.0}).stop
  assert tracker.stopped_at == 20 and tracker.stopped_at_step(20)
  resumed = best.BestTracker(metric="loss", mode="min", patience=1)
  resumed.load(tracker.state())
  assert resumed.stopped_at_step(20) and not resumed.stopped_at_step(10)
  patient = best.BestTracker(metric="loss", mode="min", patience=3)
  patient.load(tracker.state())
  assert not patient.stopped_at_step(20)  # More patience now: trains on.
  assert not best.BestTracker(metric="loss", mode="min").stopped_at_step(20)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (4, 1, 3),
                                   (3, 3, 2, 5)])
def test_a_flat_range_is_its_boxes_and_within_its_bounding_box(shape):
  from tfdist import flat_layout  # pylint: disable=g-import-not-at-top
  array = np.arange(math.prod(shape)).reshape(shape)

  def read(box):
    begins, sizes = box
    return array[tuple(slice(b, b + s) for b, s in zip(begins, sizes))]

  for start in range(array.size):
    for end in range(start + 1, array.size + 1):
      boxes = flat_layout.boxes(shape, start, end)
      assert len(boxes) <= 2 * len(shape) - 1
      np.testing.assert_array_equal(np.concatenate(
          [read(box).reshape(-1) for box in boxes]), np.arange(start, end))
      box = read(flat_layout.bounding_box(shape, start, end))
      assert set(range(start, end)) <= set(box.reshape(-1).tolist())
      for d in range(len(shape)):  # Each face holds one of the range.
        for face in (np.take(box, 0, axis=d), np.take(box, -1, axis=d)):
          assert ((face >= start) & (face < end)).any()
