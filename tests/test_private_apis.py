"""Every private TensorFlow or Keras API tfdist relies on, exercised
directly, so that a release that renames or changes one fails here, by
name and with the installed versions, before a run trains wrong.

setup.cfg bounds TensorFlow and Keras to the minor versions this file
has passed (checked at the bottom)."""

import configparser
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import ROOT

VERSIONS = f"TensorFlow {tf.__version__}, Keras {keras.__version__}"


def test_replica_id_in_sync_group_is_a_python_int(two_cpu_strategy):
  """collectives and sharded_optimizer index Python lists with it."""
  strategy = two_cpu_strategy

  def replica_fn():
    context = tf.distribute.get_replica_context()
    private = context._replica_id_in_sync_group  # pylint: disable=protected-access
    assert isinstance(private, int), VERSIONS
    return tf.constant(private) - context.replica_id_in_sync_group

  values = strategy.experimental_local_results(strategy.run(replica_fn))
  assert [int(v) for v in values] == [0, 0], VERSIONS


def test_collective_launchers_keep_their_keys_and_token():
  """tfdist.collectives runs its reduce-scatter on the launchers that
  CollectiveAllReduce keeps, with their own device, group size and key,
  instance keys and ordering token."""
  from tfdist import collectives  # pylint: disable=g-import-not-at-top
  strategy = collectives.mirrored_with_collectives(["/cpu:0", "/cpu:1"])
  launchers = strategy.extended._cross_device_ops._launchers  # pylint: disable=protected-access
  assert len(launchers) == 2, VERSIONS
  for launcher in launchers:
    assert isinstance(launcher._device, str), VERSIONS  # pylint: disable=protected-access
    assert launcher._group_size == 2, VERSIONS  # pylint: disable=protected-access
    assert isinstance(launcher._group_key, int), VERSIONS  # pylint: disable=protected-access
    assert callable(launcher._next_instance_key), VERSIONS  # pylint: disable=protected-access
    assert callable(launcher._get_ordering_token), VERSIONS  # pylint: disable=protected-access
  # Their use, a reduce-scatter and all-gather equal to numpy's, is
  # tests/test_collectives.py's (in processes of their own: instance keys
  # are per process).
  assert collectives.ShardCollectives(strategy, length=4).shard_size == 2


def test_a_layer_runs_the_call_set_on_it_over_released_storage():
  """tfdist.sharded_params runs each unit through a `call` set on the
  layer (Keras's __call__ must look it up on the instance) inside a
  StatelessScope, and frees a Keras variable's storage by replacing its
  `_value` (its shape must stay the layer's, and a read outside the
  scope must fail, not use stale values)."""
  from tfdist import released  # pylint: disable=g-import-not-at-top
  layer = keras.layers.Dense(2)
  layer.build((None, 3))
  kernel, bias = layer.kernel, layer.bias
  kernel._value = released.ReleasedWeight(  # pylint: disable=protected-access
      None, "kernel", kernel)
  assert tuple(kernel.shape) == (3, 2), VERSIONS
  with pytest.raises(Exception, match="outside its own layer.s call"):
    layer(tf.ones([1, 3]))
  original, calls = layer.call, []

  def call(*args, **kwargs):
    calls.append(args)
    with keras.StatelessScope([(kernel, tf.ones([3, 2])),
                               (bias, tf.zeros([2]))]):
      return original(*args, **kwargs)

  object.__setattr__(layer, "call", call)
  np.testing.assert_allclose(layer(tf.ones([1, 3])).numpy(), [[3.0, 3.0]])
  assert len(calls) == 1, VERSIONS


def test_a_keras_variable_saves_and_restores_through_its_value(tmp_path):
  """A released Keras variable's checkpoint entry is its `_value`'s
  (Keras's TF Variable delegates _serialize_to_tensors and
  _restore_from_tensors to it): tfdist.sharded_params saves a sharded
  weight whole, and restores it into the shards, through that."""
  from tfdist import released  # pylint: disable=g-import-not-at-top

  class Owner:
    def __init__(self, value):
      self.value, self.restored = value, {}

    def whole(self, key):
      del key
      return self.value

  layer = keras.layers.Dense(2)
  layer.build((None, 3))
  path = tf.train.Checkpoint(layer=layer).write(str(tmp_path / "plain"))
  saving = Owner(tf.fill([3, 2], 7.0))
  layer.kernel._value = released.ReleasedWeight(  # pylint: disable=protected-access
      saving, "kernel", layer.kernel)
  sharded = tf.train.Checkpoint(layer=layer).write(str(tmp_path / "sharded"))
  reader = tf.train.load_checkpoint(sharded)
  assert sorted(reader.get_variable_to_shape_map()) == sorted(
      tf.train.load_checkpoint(path).get_variable_to_shape_map()), VERSIONS
  [key] = [k for k in reader.get_variable_to_shape_map() if "kernel" in k]
  np.testing.assert_array_equal(reader.get_tensor(key), 7.0)
  restoring = Owner(tf.zeros([3, 2]))
  layer.kernel._value = released.ReleasedWeight(  # pylint: disable=protected-access
      restoring, "kernel", layer.kernel)
  tf.train.Checkpoint(layer=layer).read(sharded).assert_consumed()
  np.testing.assert_array_equal(restoring.restored["kernel"], 7.0)


def test_a_trackable_restores_one_box_of_a_whole_entry(tmp_path):
  """tfdist.sliced_restore: an entry saved whole is restored as the box
  `_serialize_to_tensors` names with a slice spec, {spec: placeholder}
  (TF reads the spec, not the placeholder's shape); the restore gets the
  box alone. TF gives a trackable one box per entry (several overwrite
  each other), hence one box each."""
  from tfdist import released  # pylint: disable=g-import-not-at-top
  from tfdist import sliced_restore  # pylint: disable=g-import-not-at-top

  class Owner:
    restored = {}

    def whole(self, key):
      del key
      return sliced_restore.request((4, 3), tf.float32, ((1, 0), (2, 3)))

  layer = keras.layers.Dense(3)
  layer.build((None, 4))
  layer.kernel.assign(tf.reshape(tf.range(12.0), [4, 3]))
  path = tf.train.Checkpoint(layer=layer).write(str(tmp_path / "whole"))
  layer.kernel._value = released.ReleasedWeight(  # pylint: disable=protected-access
      Owner(), "kernel", layer.kernel)
  tf.train.Checkpoint(layer=layer).read(path).assert_consumed()
  np.testing.assert_array_equal(Owner.restored["kernel"],
                                [[3, 4, 5], [6, 7, 8]])


def test_keras_keeps_its_call_context_and_autocast_scope_as_read():
  """tfdist.keras_context reads Keras's call context (the `training` an
  outer call set) and autocast scope, and enters them again for the
  backward's second run of a sharded unit."""
  from tfdist import keras_context  # pylint: disable=g-import-not-at-top
  seen = []

  class Probe(keras.layers.Layer):
    def call(self, x):
      seen.append(keras_context.capture())
      return x

  class Outer(keras.layers.Layer):
    def __init__(self, **kwargs):
      super().__init__(**kwargs)
      self.probe = Probe(dtype=kwargs.get("dtype"))

    def call(self, x, training=False):
      return self.probe(x)

  Outer()(tf.ones([1, 2]), training=True)
  plain = seen[-1]  # The eager call's (a build may call it symbolically).
  Outer(dtype="mixed_float16")(tf.ones([1, 2]), training=True)
  mixed = seen[-1]
  assert plain.call_context.training is True, VERSIONS
  assert plain.autocast is None, VERSIONS
  assert mixed.autocast.dtype == "float16", VERSIONS
  assert keras_context.capture().call_context is None, VERSIONS
  with keras_context.entered(plain):
    dropped = keras.layers.Dropout(0.9, seed=1)(tf.ones([1, 1000]))
    assert getattr(keras_context.capture().autocast, "dtype", None) is None, (
        VERSIONS)
  assert float(tf.reduce_min(dropped)) == 0.0, VERSIONS  # Inherited.
  assert keras_context.capture().call_context is None, VERSIONS
  with keras_context.entered(mixed):
    assert keras_context.capture().autocast.dtype == "float16", VERSIONS

  class Later(keras.layers.Layer):
    """Calls a layer with its own `training` after the probe's call."""
    def __init__(self):
      super().__init__()
      self.probe, self.dropout = Probe(), keras.layers.Dropout(0.5)

    def call(self, x, training=False):
      return self.dropout(self.probe(x), training=False)

  Later()(tf.ones([1, 2]), training=True)
  # Keras set training=False on its context for the dropout's call; the
  # context kept is as the probe's call saw it.
  assert seen[-1].call_context.training is True, VERSIONS


def test_a_stateless_scope_keeps_assignments_and_losses_as_read():
  """tfdist.keras_context counts a StatelessScope's entries (one per
  variable mapped or assigned) and sharded_params reads its losses."""
  from tfdist import keras_context  # pylint: disable=g-import-not-at-top
  mapped, other = keras.Variable(1.0), keras.Variable(2.0)
  scope = keras_context.stateless([(mapped, tf.constant(3.0))])
  with scope:
    mapped.assign(4.0)
    assert keras_context.assigned_count(scope) == 1, VERSIONS
    other.assign(5.0)
    scope.add_loss(tf.constant(1.0))
  assert keras_context.assigned_count(scope) == 2, VERSIONS
  assert len(scope.losses) == 1, VERSIONS
  assert float(scope.get_current_value(mapped)) == 4.0, VERSIONS
  assert float(other.numpy()) == 2.0, VERSIONS


def test_a_constant_rate_is_the_optimizers_learning_rate_variable():
  """Callbacks set the rate through it, and checkpoints key it."""
  from tfdist import callbacks  # pylint: disable=g-import-not-at-top
  optimizer = keras.optimizers.Adam(0.25)
  rate = callbacks.rate_variable(optimizer)
  assert rate is not None, VERSIONS
  rate.assign(0.5)
  assert float(optimizer.learning_rate) == 0.5, VERSIONS
  schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
  assert callbacks.rate_variable(
      keras.optimizers.Adam(schedule)) is None, VERSIONS


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw",
                                  "rmsprop"])
def test_keras_lays_out_slots_variable_after_variable(name):
  """The sharded optimizer's checkpoints assume Keras's slot layout and
  names; the check it runs at build passes on every table optimizer."""
  from tfdist import optimizers  # pylint: disable=g-import-not-at-top
  from tfdist import sharded_optimizer  # pylint: disable=g-import-not-at-top
  schedule = {"schedule": "constant", "warmup_steps": 0,
              "learning_rate": 0.1}
  make = lambda: optimizers.create(name, schedule=schedule)  # noqa: E731
  sharded_optimizer.check_slot_layout(make)  # pylint: disable=protected-access
  built = make()
  variable = keras.Variable(tf.zeros([3]), name="probe")
  built.build([variable])
  assert [v.shape for v in sharded_optimizer.slots(built)] == [
      (3,)] * len(sharded_optimizer.slots(built)), VERSIONS


def test_apply_gradients_reduces_through_the_hook_compression_replaces(
    two_cpu_strategy):
  """Keras 3's apply_gradients all-reduces by itself, through
  _all_reduce_sum_gradients; compression replaces that reduction. If the
  hook were gone or unused, gradients would be reduced twice."""
  from tfdist import compression  # pylint: disable=g-import-not-at-top
  strategy = two_cpu_strategy
  with strategy.scope():
    variable = keras.Variable(tf.zeros([2]))
    optimizer = compression.take_over_reduction(
        keras.optimizers.SGD(1.0))
    optimizer.build([variable])

  @tf.function
  def step():
    def replica_fn():
      context = tf.distribute.get_replica_context()
      grad = tf.ones([2]) * tf.cast(context.replica_id_in_sync_group + 1,
                                    tf.float32)
      optimizer.apply_gradients([(grad, variable)])
    strategy.run(replica_fn)

  step()
  # Each replica applied its own gradient, unreduced: its own -1 or -2
  # (mirrored values are read from the first replica).
  np.testing.assert_allclose(variable.numpy(), [-1.0, -1.0],
                             err_msg=VERSIONS)


def test_dataset_variant_tensor_serializes_to_a_graph():
  """tfdist.data ships in-memory datasets to PS workers as their graph."""
  dataset = tf.data.Dataset.range(5).map(lambda x: x * 2)
  graph = tf.raw_ops.DatasetToGraphV2(
      input_dataset=dataset._variant_tensor)  # pylint: disable=protected-access
  rebuilt = tf.data.experimental.from_variant(
      tf.raw_ops.DatasetFromGraph(graph_def=graph),
      structure=dataset.element_spec)
  assert list(rebuilt.as_numpy_iterator()) == [0, 2, 4, 6, 8], VERSIONS


def test_flatten_layers_reaches_nested_batch_normalization():
  """--sync_batchnorm finds BatchNormalization layers inside blocks."""
  inner = keras.Sequential([keras.layers.Dense(2),
                            keras.layers.BatchNormalization()])
  model = keras.Sequential([keras.Input([3]), inner,
                            keras.layers.BatchNormalization()])
  found = [layer for layer in model._flatten_layers()  # pylint: disable=protected-access
           if isinstance(layer, keras.layers.BatchNormalization)]
  assert len(found) == 2, VERSIONS


def test_ema_keeps_one_average_per_trainable_variable():
  """tfdist.ema swaps the averages in for evals and exports."""
  from tfdist import ema  # pylint: disable=g-import-not-at-top
  variable = keras.Variable(tf.ones([2]), name="weights")
  optimizer = keras.optimizers.SGD(0.5, use_ema=True, ema_momentum=0.5,
                                   ema_overwrite_frequency=None)
  optimizer.build([variable])
  averages = optimizer._model_variables_moving_average  # pylint: disable=protected-access
  assert len(averages) == 1, VERSIONS
  optimizer.apply_gradients([(tf.ones([2]), variable)])
  optimizer.apply_gradients([(tf.ones([2]), variable)])
  raw = variable.numpy()
  with ema.averaged_weights(optimizer):
    averaged = variable.numpy()
  np.testing.assert_allclose(averaged, averages[0].numpy(), err_msg=VERSIONS)
  assert not np.allclose(averaged, raw), VERSIONS
  np.testing.assert_allclose(variable.numpy(), raw, err_msg=VERSIONS)


_MULTI_WORKER_CHECK = """
import tensorflow as tf
strategy = tf.distribute.MultiWorkerMirroredStrategy()
from tfdist import runners
context = runners.plain_input_context(strategy)
print(context.num_input_pipelines, context.input_pipeline_id,
      context.num_replicas_in_sync)
"""


def test_multi_worker_input_context_names_this_workers_slice():
  """The plain train feed of MultiWorkerMirrored takes this worker's
  InputContext from extended._make_input_context (2 workers: pipeline 0
  and 1 of 2); without it tfdist stops, since a one-pipeline fallback
  would give every worker the same slice."""
  import json  # pylint: disable=g-import-not-at-top
  import portpicker  # pylint: disable=g-import-not-at-top
  from tfdist import cluster  # pylint: disable=g-import-not-at-top
  ports = [portpicker.pick_unused_port() for _ in range(2)]
  configs = cluster.build_tf_configs(
      {"worker": [f"127.0.0.1:{port}" for port in ports]})
  procs = [subprocess.Popen(
      [sys.executable, "-c", _MULTI_WORKER_CHECK], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env={**os.environ, "TF_CONFIG": json.dumps(configs[("worker", i)])})
           for i in range(2)]
  outputs = [proc.communicate(timeout=120) for proc in procs]
  for i, (out, err) in enumerate(outputs):
    assert procs[i].returncode == 0, err[-2000:]
    assert out.split() == ["2", str(i), "2"], VERSIONS


def test_setup_cfg_bounds_tensorflow_and_keras_to_what_passed_here():
  config = configparser.ConfigParser()
  config.read(os.path.join(ROOT, "setup.cfg"))
  extras = config["options.extras_require"]
  requires = config["options"]["install_requires"]
  def below_next_minor(package, version):
    major, minor = version.split(".")[:2]
    return re.compile(rf"^{re.escape(package)}>=[0-9.]+,<{major}\."
                      rf"{int(minor) + 1}$", re.M)
  assert below_next_minor("tensorflow-cpu", tf.__version__).search(
      extras["cpu"]), VERSIONS
  assert below_next_minor("tensorflow[and-cuda]", tf.__version__).search(
      extras["gpu"]), VERSIONS
  assert below_next_minor("keras", keras.__version__).search(
      requires), VERSIONS


def test_tracking_bases_of_the_sharded_checkpoint_view():
  """The sharded optimizer's checkpoint view is built on TF's tracking
  bases, under the children names Keras's optimizer has."""
  assert issubclass(tf.__internal__.tracking.AutoTrackable,
                    tf.__internal__.tracking.Trackable), VERSIONS
  optimizer = keras.optimizers.Adam(0.1)
  optimizer.build([keras.Variable(tf.zeros([2]))])
  children = tf.train.TrackableView(optimizer).children(optimizer)
  for name in ("_iterations", "_learning_rate", "_trainable_variables",
               "_variables"):
    assert name in children, (name, sorted(children), VERSIONS)


def test_checkpoint_object_graph_maps_model_variables():
  """Warm start finds each model variable's key by walking the
  checkpoint's object graph (trackable_object_graph_pb2, TrackableView)
  beside the model, as TF's restore does."""
  import tempfile  # pylint: disable=g-import-not-at-top
  from tfdist import warm_start  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input([3]), keras.layers.Dense(2)])
  optimizer = keras.optimizers.SGD(0.1)
  optimizer.build(model.trainable_variables)
  with tempfile.TemporaryDirectory() as directory:
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
        f"{directory}/ckpt")
    reader = tf.train.load_checkpoint(path)
    keys = warm_start.checkpoint_keys(model, reader)
    for variable in model.weights:
      np.testing.assert_array_equal(
          reader.get_tensor(keys[id(variable)]), variable.numpy(),
          err_msg=VERSIONS)


def test_the_dispatcher_takes_its_config_proto():
  """launch.data_service builds TF's DispatcherConfig proto (the Python
  DispatcherConfig has no gc_dynamic_sharding_jobs); DispatchServer takes
  the proto as it is. test_data_service checks that jobs are collected."""
  from tensorflow.core.protobuf import service_config_pb2  # pylint: disable=g-import-not-at-top
  from launch import data_service  # pylint: disable=g-import-not-at-top
  config = data_service.dispatcher_config(port=0, work_dir="")
  assert isinstance(config, service_config_pb2.DispatcherConfig), VERSIONS
  assert config.gc_dynamic_sharding_jobs, VERSIONS
  server = tf.data.experimental.service.DispatchServer(config)
  assert server.target.startswith("grpc://"), VERSIONS
  server.stop()


def test_a_shuffle_in_a_traced_function_ignores_the_global_seed():
  """tfdist.data.randomness sets a traced function's graph seed aside
  around a shuffle (TF's get_seed reads it): the order then depends on
  the shuffle's own seed only, and a global seed of 0 does not fail the
  trace. If TF stops reading the function graph's seed, the orders
  below differ (and --seed=0 fails again)."""
  from tfdist.data import randomness  # pylint: disable=g-import-not-at-top

  def order_under(global_seed):
    tf.random.set_seed(global_seed)
    try:
      epochs = tf.data.Dataset.range(2).flat_map(
          lambda epoch: randomness.shuffle(tf.data.Dataset.range(20), 20,
                                           epoch + 7))
      return [int(x) for x in epochs]
    finally:
      tf.random.set_seed(None)
  assert order_under(0) == order_under(5) == order_under(123), VERSIONS


def test_the_service_splits_the_sources_tfdist_names():
  """tfdist.data.sources.splits_by_source reads TF's dataset op names
  (RangeDataset, ParallelMapDatasetV2, ...): a release that renames one
  would send such pipelines back to units (4x the data workers' CPU)
  without an error. Each of these must still be split at its source;
  the others not."""
  from tfdist.data import sources  # pylint: disable=g-import-not-at-top
  numbers = tf.data.Dataset.range(8)
  files = tf.data.TFRecordDataset(["/nonexistent/a", "/nonexistent/b"])
  split = [numbers.map(lambda x: x + 1),
           numbers.map(lambda x: x + 1, num_parallel_calls=2),
           numbers.filter(lambda x: x > 1).shuffle(4).prefetch(1),
           files.map(tf.strings.length),
           tf.data.Dataset.from_tensor_slices(["a", "b"]).interleave(
               tf.data.TFRecordDataset, num_parallel_calls=2),
           tf.data.Dataset.from_tensor_slices(np.zeros((4, 2)))]
  kept_whole = [numbers.cache(), numbers.take(3), numbers.skip(1),
                numbers.batch(2), numbers.enumerate(),
                tf.data.Dataset.zip(numbers, numbers),
                numbers.apply(tf.data.experimental.assert_cardinality(8))]
  assert [sources.splits_by_source(d) for d in split] == [True] * 6, VERSIONS
  assert not any(sources.splits_by_source(d) for d in kept_whole), VERSIONS


def test_a_range_source_is_rebuilt_in_chunks():
  """tfdist.data.chunked_range edits DatasetToGraphV2's GraphDef: a
  RangeDataset node whose three inputs are Const nodes, a _Retval node
  naming the output. A release that serializes otherwise would send a
  range's splits back to one element each (an RPC per example on the
  tf.data service): chunked() would return the pipeline unchanged."""
  from tfdist.data import chunked_range  # pylint: disable=g-import-not-at-top
  from tfdist.data import sources  # pylint: disable=g-import-not-at-top
  pipeline = tf.data.Dataset.range(3, 10_000, 2).map(lambda x: x * 2)
  rebuilt = chunked_range.chunked(pipeline)
  assert rebuilt is not pipeline, VERSIONS
  graph = sources.pipeline_graph(rebuilt)
  nodes = {node.name: node for node in graph.node}
  (source,) = [node for node in graph.node if node.op == "RangeDataset"]
  bounds = [int(tf.make_ndarray(nodes[name].attr["value"].tensor))
            for name in source.input]
  assert bounds == [3, 10_000, 2 * chunked_range.CHUNK], VERSIONS
  # The same examples in the same order and of the same dtype, for a
  # step down and an int32 range too; a range near int64's end, whose
  # chunks would overflow, is left as it is.
  for original in (pipeline,
                   tf.data.Dataset.range(5_000, -3, -7).map(lambda x: x + 1),
                   tf.data.Dataset.range(0, 5_000, output_type=tf.int32)):
    again = chunked_range.chunked(original)
    assert again is not original, VERSIONS
    # Read through an iterator, which fails on a dtype other than the
    # spec's; the values' own dtypes are compared too.
    got, want = (np.asarray(list(d.as_numpy_iterator()))
                 for d in (again, original))
    assert got.dtype == want.dtype, VERSIONS
    np.testing.assert_array_equal(got, want, err_msg=VERSIONS)
  edge = tf.data.Dataset.range(2**63 - 5_000, 2**63 - 1)
  assert chunked_range.chunked(edge) is edge, VERSIONS
  # A pipeline that carries its data (over MAX_GRAPH_BYTES) is not
  # rebuilt: the rebuild would hold copies of it.
  rows = np.zeros((chunked_range.MAX_GRAPH_BYTES // 4000 + 1, 1000),
                  np.float32)
  carried = tf.data.Dataset.range(len(rows)).map(
      lambda i: tf.gather(rows, i))
  assert chunked_range.chunked(carried) is carried, VERSIONS


def test_the_auto_shard_rewrite_deals_out_a_pipelines_files(tmp_path):
  """tfdist.data.sharding.files_of_host: TF's _AutoShardDataset with the
  FILE policy gives host h of 2 files h, h + 2 of a TFRecordDataset's
  list, and fails on host 0 when there are fewer files than hosts (what
  --input_sharding=auto tries)."""
  from tfdist.data import sharding  # pylint: disable=g-import-not-at-top
  paths = [str(tmp_path / f"part-{f}") for f in range(3)]
  for number, path in enumerate(paths):
    with tf.io.TFRecordWriter(path) as out:
      out.write(str(number).encode())
  pipeline = tf.data.TFRecordDataset(paths)
  dealt = [[int(r) for r in sharding.files_of_host(pipeline, 2, host)]
           for host in range(2)]
  assert dealt == [[0, 2], [1]], VERSIONS
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="Could not apply FILE based sharding"):
    list(sharding.files_of_host(pipeline, 4, 0))


def test_a_parameter_server_dataset_function_finds_its_worker():
  """tfdist.data.pipeline's file sharding on parameter servers switches
  on this public-but-experimental function (tests/test_file_runs.py runs
  it on 2 workers); a release that drops it fails here by name."""
  assert callable(
      tf.distribute.coordinator.experimental_get_current_worker_index), (
          VERSIONS)


class _PiecewiseEntry(tf.__internal__.tracking.Trackable):
  """A checkpoint entry of a sharded run, as tfdist.released's."""

  def __init__(self, save, value):
    self._save, self._value = save, value

  def _serialize_to_tensors(self):
    return {"VARIABLE_VALUE": self._save.entry("entry", tf.float32)}

  @property
  def _shared_name(self):
    return "entry"


def test_a_value_less_save_spec_is_keyed_and_written_after(tmp_path):
  """tfdist.piecewise_save: TF's saver records a SaveSpec whose tensor is
  None in the object graph, names it with its checkpoint key and writes
  no value; a write callback runs before the manager names the
  checkpoint the latest; what it merges in, a plain variable restores
  (assert_consumed: every key in place). A failed write leaves the
  checkpoint before as the latest, and no piece behind."""
  from tfdist import piecewise_save  # pylint: disable=g-import-not-at-top
  value = np.arange(6, dtype=np.float32).reshape(2, 3)
  device = tf.Variable(0.0).device
  manager = tf.train.CheckpointManager(
      tf.train.Checkpoint(step=tf.Variable(1), entry=_PiecewiseEntry(
          None, value)), str(tmp_path / "run"), max_to_keep=3)
  seen = {}

  def save(step, fail=False):
    entry = manager.checkpoint.entry
    entry._save = piecewise_save.PiecewiseSave(device=device)

    def write(path):
      seen["latest"] = manager.latest_checkpoint
      seen["before"] = dict(tf.train.list_variables(path))
      pieces = [{"entry": tf.constant(value)}]
      if fail:
        pieces.append({"entry": None})
      entry._save.write(path, iter(pieces))

    return manager.save(step, options=tf.train.CheckpointOptions(
        experimental_write_callbacks=[write]))

  path = save(1)
  key = "entry/.ATTRIBUTES/VARIABLE_VALUE"
  assert seen["latest"] is None, VERSIONS
  assert key not in seen["before"] and "step" in str(seen["before"])
  assert dict(tf.train.list_variables(path))[key] == [2, 3], VERSIONS
  restored = tf.train.Checkpoint(step=tf.Variable(0),
                                 entry=tf.Variable(tf.zeros([2, 3])))
  restored.restore(path).assert_consumed()
  np.testing.assert_array_equal(restored.entry.numpy(), value)
  with pytest.raises(Exception):
    save(2, fail=True)
  assert manager.latest_checkpoint == path, VERSIONS
  assert not [p for p in os.listdir(tmp_path / "run") if "_piece" in p
              or "_merged" in p]
  # A save killed while it wrote leaves pieces: the next save removes
  # them, and nothing else.
  for name in ("ckpt-2_piece0.index", "ckpt-2_merged.data-00000-of-00001",
               "ckpt-2_piece_notes.txt"):
    (tmp_path / "run" / name).write_text("x")
  save(3)
  assert sorted(p for p in os.listdir(tmp_path / "run") if "_p" in p
                or "_m" in p) == ["ckpt-2_piece_notes.txt"]



def test_a_deferred_keras_variable_is_listed_and_initialized_later():
  """tfdist.released: a Keras variable made in a StatelessScope that does
  not initialize has no value, sits in Keras's (thread-local) list of
  uninitialized variables, and `_deferred_initialize` gives it its
  initializer's value; a read before that runs the initializer."""
  from keras.src.backend.common import global_state  # pylint: disable=g-import-not-at-top
  with keras.StatelessScope(initialize_variables=False):
    variable = keras.Variable(keras.initializers.Constant(2.0), shape=(3,))
  assert variable._value is None, VERSIONS  # pylint: disable=protected-access
  pending = global_state.get_global_attribute("uninitialized_variables")
  assert any(v is variable for v in pending), VERSIONS
  np.testing.assert_array_equal(variable.numpy(), [2.0] * 3)
  global_state.set_global_attribute("uninitialized_variables", [])
  variable._deferred_initialize()  # pylint: disable=protected-access
  assert isinstance(variable._value, tf.Variable), VERSIONS  # pylint: disable=protected-access
  np.testing.assert_array_equal(variable.numpy(), [2.0] * 3)
