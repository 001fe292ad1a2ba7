"""tfdist.sharded_params's plan of units and its refusals, in process.
Its numbers (one device's weights, BatchNorm, dropout, a layer called
twice, on mirrored and two MultiWorkerMirrored processes) are
tests/test_collectives.py's."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import collectives
from tfdist import released
from tfdist import sharded_params
from tfdist import units
from tfdist.errors import ConfigError


def _strategy():
  return collectives.mirrored_with_collectives(["/cpu:0", "/cpu:1"])


def _sgd():
  return keras.optimizers.SGD(0.1)


def _sharded(make_model, make_optimizer=_sgd, **kwargs):
  strategy = _strategy()
  with strategy.scope():
    model = make_model()
  return strategy, model, sharded_params.ShardedParams(
      strategy=strategy, model=model, make_optimizer=make_optimizer,
      **kwargs)


def _step(strategy, model, sharded):
  """A traced step: the replicas' summed loss, the shards updated."""
  @tf.function
  def step(x):
    def replica_fn(x):
      with tf.GradientTape() as tape:
        with sharded.gathering():
          loss = tf.reduce_sum(model(x, training=True))
      sharded.apply(tape.gradient(loss, sharded.variables()))
      return loss
    return strategy.reduce("SUM", strategy.run(replica_fn, args=(x,)),
                           axis=None)
  return step


def test_each_layer_with_weights_is_a_unit():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                            keras.layers.Dropout(0.1),
                            keras.layers.BatchNormalization(),
                            keras.layers.Dense(2)])
  planned = units.plan_units(model)
  assert [u.layer.name for u in planned] == [
      model.layers[i].name for i in (0, 2, 3)]
  assert [u.layout.size for u in planned] == [15, 6, 8]
  assert [len(u.states) for u in planned] == [0, 2, 0]


def test_a_weight_the_model_owns_is_refused():
  class Scaled(keras.Model):
    def __init__(self):
      super().__init__()
      self.dense = keras.layers.Dense(2)
      self.scale = self.add_weight(shape=(), initializer="ones",
                                   name="scale")

    def call(self, x):
      return self.dense(x) * self.scale

  model = Scaled()
  model(tf.ones([1, 3]))
  with pytest.raises(ConfigError, match="belong to no layer.*scale"):
    units.plan_units(model)


def test_a_weight_two_layers_share_is_refused():
  class Tied(keras.layers.Layer):
    def __init__(self, other):
      super().__init__()
      self.other = other

    def call(self, x):
      return tf.matmul(x, self.other.kernel, transpose_b=True)

  dense = keras.layers.Dense(3)
  inputs = keras.Input((3,))
  model = keras.Model(inputs, Tied(dense)(dense(inputs)))
  with pytest.raises(ConfigError, match="share a weight"):
    units.plan_units(model)


def test_a_weight_regularizer_is_refused():
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
      2, kernel_regularizer="l2")])
  with pytest.raises(ConfigError, match="regularizer.*kernel"):
    units.plan_units(model)


def test_gathering_puts_the_layers_back_even_when_the_call_fails():
  strategy = _strategy()
  with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  sharded = sharded_params.ShardedParams(strategy=strategy, model=model,
                                         make_optimizer=_sgd)
  with pytest.raises(RuntimeError, match="inside"):
    with sharded.gathering():
      assert "call" in vars(model.layers[0])
      raise RuntimeError("inside")
  assert "call" not in vars(model.layers[0])


def test_a_released_weight_is_not_read_outside_gathering():
  strategy = _strategy()
  with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  whole = [v.numpy() for v in model.trainable_variables]
  sharded = sharded_params.ShardedParams(strategy=strategy, model=model,
                                         make_optimizer=_sgd)
  with pytest.raises(Exception, match="outside its own layer.s call"):
    model(tf.ones([1, 3]))
  with pytest.raises(ConfigError, match="outside its own layer.s call"):
    model.get_weights()
  with pytest.raises(ConfigError, match="outside its own layer.s call"):
    model.set_weights([w + 1 for w in whole])
  assert released.held_weights(model) == []
  [gathered] = sharded.gathered_weights()
  for got, want in zip(gathered, whole, strict=True):
    assert (got == want).all()


def test_a_deferred_build_shards_the_initializers_values():
  """--shard=params builds the model deferred (tfdist.released): no unit
  weight is ever a variable of its own, the shards hold what a whole
  build's weights are (the initializers are seeded), and the variables
  no unit shards (a BatchNorm's statistics) get their values after."""
  def make():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                             keras.layers.BatchNormalization(),
                             keras.layers.Dense(2)])
  strategy = _strategy()
  with strategy.scope():
    reference = make()
  with strategy.scope():
    model, why = released.build_deferred(make)
  assert why is None
  assert all(v._value is None for v in model.weights)  # pylint: disable=protected-access
  sharded = sharded_params.ShardedParams(strategy=strategy, model=model,
                                         make_optimizer=_sgd)
  with strategy.scope():
    released.initialize_held()
  gathered = [w for unit in sharded.gathered_weights() for w in unit]
  for got, want in zip(gathered, reference.trainable_variables, strict=True):
    assert (got == want.numpy()).all()
  held = released.held_weights(model)
  for got, want in zip(held, reference.non_trainable_variables, strict=True):
    assert got._value is not None  # pylint: disable=protected-access
    assert (got.numpy() == want.numpy()).all()
  assert _step(strategy, model, sharded)(tf.ones([2, 3])).shape == []


def _dense_model(**dense):
  return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, **dense),
                           keras.layers.Dense(2)])


def _assigned():
  model = _dense_model()
  model.layers[0].kernel.assign(tf.ones([3, 4]))  # As load_weights does.
  return model


@pytest.mark.parametrize("build,why", [
    (_assigned, "assigns a value to a variable while it is built"),
    (lambda: _dense_model(kernel_initializer=lambda shape, dtype=None:
                          tf.random.normal(shape)),
     "not a Keras initializer"),
    (lambda: _dense_model(kernel_initializer=keras.initializers.HeNormal(
        seed=keras.random.SeedGenerator(1))), "with a SeedGenerator"),
])
def test_a_model_whose_reads_would_differ_is_not_deferred(build, why):
  """Its deferred reads would not give what a whole build holds: it is
  built whole instead, under the names a whole build would give."""
  from keras.src.utils import naming  # pylint: disable=g-import-not-at-top
  naming.reset_uids()
  names = [w.path for w in build().weights]
  naming.reset_uids()
  model, reason = released.build_deferred(build)
  assert model is None and why in reason
  assert [w.path for w in build().weights] == names


def test_a_model_of_keras_initializers_is_deferred():
  model, reason = released.build_deferred(_dense_model)
  assert reason is None
  assert all(v._value is None for v in model.weights)  # pylint: disable=protected-access
  released.forget_deferred()


def test_it_is_built_outside_the_strategys_scope():
  strategy = _strategy()
  with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(RuntimeError, match="outside"):
      sharded_params.ShardedParams(strategy=strategy, model=model,
                                   make_optimizer=_sgd)


def test_the_layers_of_a_nested_model_are_units_each_once():
  inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                            keras.layers.Dense(4)])
  inputs = keras.Input((4,))
  model = keras.Model(inputs, keras.layers.Dense(2)(inner(inner(inputs))))
  assert [u.layer for u in units.plan_units(model)] == [
      *inner.layers, model.layers[-1]]


def test_a_model_without_weights_is_refused():
  with pytest.raises(ConfigError, match="no trainable weights"):
    units.plan_units(keras.Sequential([keras.layers.Dense(2)]))


def test_a_weight_constraint_is_refused():
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
      2, kernel_constraint="non_neg")])
  with pytest.raises(ConfigError, match="constraint.*kernel"):
    units.plan_units(model)


class _AddsLoss(keras.layers.Layer):
  def build(self, shape):
    self.kernel = self.add_weight(shape=(shape[-1], 2))

  def call(self, x):
    self.add_loss(tf.reduce_sum(self.kernel))
    return tf.matmul(x, self.kernel)


class _AssignsOutside(keras.layers.Layer):
  """Counts its calls in a variable it does not own (reached through a
  function, which Keras does not track)."""

  def __init__(self, counter):
    super().__init__()
    self.count = lambda: counter.assign_add(1.0)

  def build(self, shape):
    self.kernel = self.add_weight(shape=(shape[-1], 2))

  def call(self, x):
    self.count()
    return tf.matmul(x, self.kernel)


class _AssignsItsWeight(_AddsLoss):
  def call(self, x):
    self.kernel.assign(self.kernel * 0.5)
    return tf.matmul(x, self.kernel)


@pytest.mark.parametrize("make_layer,match", [
    (_AddsLoss, "adds a loss"),
    (lambda: _AssignsOutside(keras.Variable(0.0, trainable=False)),
     "does not own"),
    (_AssignsItsWeight, "its own trainable weights")])
def test_what_the_scope_would_lose_is_refused(make_layer, match):
  strategy, model, sharded = _sharded(lambda: keras.Sequential(
      [keras.Input((3,)), make_layer()]))
  # Raised while the step is traced: autograph and Keras wrap it.
  with pytest.raises(Exception, match=f"(?s)ConfigError.*{match}"):
    _step(strategy, model, sharded)(tf.ones([4, 3]))


def test_gathering_nests_and_keeps_a_call_of_the_users_own():
  strategy, model, sharded = _sharded(lambda: keras.Sequential(
      [keras.Input((3,)), keras.layers.Dense(2)]))
  layer = model.layers[0]
  own = layer.call
  object.__setattr__(layer, "call", own)
  with sharded.gathering():
    patched = layer.call
    with sharded.gathering():
      assert layer.call is patched
    assert layer.call is patched
  assert vars(layer)["call"] is own


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_step_traced_again_for_another_batch(prefetch):
  """A second trace (a shorter batch), with or without prefetch, gives
  the unsharded sums (TF turns a tensor of another trace into a capture
  rather than failing, so this does not show that none is taken)."""
  strategy, model, sharded = _sharded(lambda: keras.Sequential(
      [keras.Input((3,)), keras.layers.Dense(
          2, kernel_initializer="ones", bias_initializer="zeros")]),
                                      prefetch=prefetch)
  step = _step(strategy, model, sharded)
  # Each of the 2 replicas: rows x 2 outputs x 3 (the kernel all ones).
  assert float(step(tf.ones([4, 3]))) == 2 * 4 * 2 * 3
  # The summed gradients were 2 x 4 for each weight: kernel 1 - 0.1 x 8,
  # bias -0.8; each output 3 x 0.2 - 0.8 on 2 rows, 2 outputs, 2 replicas.
  assert float(step(tf.ones([2, 3]))) == pytest.approx(2 * 2 * 2 * -0.2)


def _op_counts(concrete, types):
  """{op type: count} over a traced function's graph and the functions it
  calls (the custom gradients' forward and backward), each function once."""
  graph_def = concrete.graph.as_graph_def()
  nodes = list(graph_def.node)
  for function in graph_def.library.function:
    nodes.extend(function.node_def)
  return {t: sum(n.op == t for n in nodes) for t in types}


@pytest.mark.parametrize("reshard,gathers", [(True, 2), (False, 1)])
def test_a_step_has_one_or_two_gathers_and_one_reduce_scatter_per_unit(
    reshard, gathers):
  strategy, model, sharded = _sharded(lambda: keras.Sequential(
      [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(4),
       keras.layers.Dense(2)]), reshard=reshard)
  step = _step(strategy, model, sharded)
  counts = _op_counts(step.get_concrete_function(tf.ones([4, 3])),
                      ("CollectiveGatherV2", "CollectiveAllToAllV2"))
  # Per replica (2) and unit (3): a gather in the forward, another in the
  # backward with reshard on, and the reduce-scatter's all-to-all.
  assert counts == {"CollectiveGatherV2": 2 * 3 * gathers,
                    "CollectiveAllToAllV2": 2 * 3}, counts


def _shared_layer_model():
  inputs = keras.Input((3,))
  shared = keras.layers.Dense(3, kernel_initializer="ones", name="shared")
  outputs = keras.layers.Dense(2, name="head")(shared(shared(inputs)))
  return keras.Model(inputs, outputs)


class WithANestedFunction(keras.Model):
  """Units "a" and "b": "a" called in the step's graph, then `nested`
  called in a nested function's graph (its backward in another graph),
  then "a" again (`nested="b"`: "a" twice in the step's graph) or "b"
  (`nested="a"`: "a" in both graphs)."""

  def __init__(self, nested):
    super().__init__()
    self.a = keras.layers.Dense(3, name="a")
    self.b = keras.layers.Dense(3, name="b")
    self.nested, self.last = getattr(self, nested), (
        self.a if nested == "b" else self.b)
    self.inner = tf.function(self.run_nested)

  def run_nested(self, x):
    return self.nested(x)

  def call(self, x):
    return self.last(self.inner(self.a(x)))


def _around_a_function():
  model = WithANestedFunction("b")
  model(tf.ones([1, 3]))
  return model


def _in_and_out_of_a_function():
  model = WithANestedFunction("a")
  model(tf.ones([1, 3]))
  return model


def _recorded_apply(sharded):
  """What apply() gets, at each replica's trace."""
  applied = []
  apply = sharded.apply
  sharded.apply = lambda grads: applied.append(grads) or apply(grads)
  return applied


@pytest.mark.parametrize("make_model,kwargs,left_to_apply", [
    (_shared_layer_model, {}, ["shared"]),  # Its gradient is a sum.
    (_shared_layer_model, {"update_in_backward": False}, ["shared", "head"]),
    (_shared_layer_model, {"clip_norm": 1.0}, ["shared", "head"]),
    (_around_a_function, {}, ["a", "b"])])
def test_a_unit_called_once_is_updated_in_its_backward(make_model, kwargs,
                                                        left_to_apply):
  strategy, model, sharded = _sharded(make_model, **kwargs)
  applied = _recorded_apply(sharded)
  step = _step(strategy, model, sharded)
  before = sharded.gathered_weights()
  step(tf.ones([4, 3]))
  names = [unit.layer.name for unit in sharded.units]
  # The units still to update when the backward is done.
  assert [[n for n, g in zip(names, grads) if g is not None]
          for grads in applied] == [left_to_apply] * 2
  after = sharded.gathered_weights()
  for unit_before, unit_after in zip(before, after):  # Each was updated.
    assert not any((b == a).all() for b, a in zip(unit_before, unit_after))


@pytest.mark.parametrize("make_model,in_its_backward", [
    (_shared_layer_model, ["head"]), (_around_a_function, []),
    (_in_and_out_of_a_function, ["b"])])
def test_an_update_in_the_backward_is_the_update_after_it(make_model,
                                                          in_its_backward):
  """Adam (its step count and bias correction read in the backward),
  three steps: the same weights and slots either way; a unit called
  twice anywhere in the step is updated once, after the backward."""
  def adam():
    return keras.optimizers.Adam(0.1)
  runs = []
  for in_backward in (True, False):
    keras.utils.set_random_seed(3)  # The same initial weights.
    strategy, model, sharded = _sharded(
        make_model, make_optimizer=adam, update_in_backward=in_backward)
    applied = _recorded_apply(sharded)
    step = _step(strategy, model, sharded)
    for x in (tf.ones([4, 3]), tf.fill([4, 3], 2.0), tf.ones([4, 3])):
      step(x)
    runs.append((sharded.gathered_weights(),
                 [v.numpy() for v in sharded.optimizers[0].variables]))
    names = [unit.layer.name for unit in sharded.units]
    assert [n for n, g in zip(names, applied[0]) if g is None] == (
        in_its_backward if in_backward else [])
  for mine, theirs in zip(tf.nest.flatten(runs[0]), tf.nest.flatten(runs[1])):
    np.testing.assert_allclose(mine, theirs, rtol=1e-6)


def _momentum():
  return keras.optimizers.SGD(0.1, momentum=0.9)


def _checkpoint(model, sharded):
  return tf.train.Checkpoint(model=model, optimizer=sharded.checkpoint_view(
      _momentum(), model.trainable_variables))


def test_a_restore_reads_only_the_box_its_shards_hold(tmp_path):
  """Saved whole, a unit at a time; restored as the process holding only
  shard 1 would: each entry's smallest box that holds shard 1's part."""
  def make_model():  # Kernel 7 x 5, then bias 5: a shard of 20 of 40.
    return keras.Sequential([keras.Input((7,)), keras.layers.Dense(5),
                             keras.layers.Dense(3)])
  strategy, model, sharded = _sharded(make_model, make_optimizer=_momentum)
  _step(strategy, model, sharded)(tf.ones([4, 7]))  # Momentum slots too.
  with sharded.saving() as write:
    path = _checkpoint(model, sharded).write(
        str(tmp_path / "ckpt"), options=tf.train.CheckpointOptions(
            experimental_write_callbacks=[write]))
  _, model2, restored = _sharded(make_model, make_optimizer=_momentum)
  restored._ranks = [1]  # pylint: disable=protected-access
  _checkpoint(model2, restored).restore(path).expect_partial()
  # Shard 1 of unit 0: kernel elements 20-34 (rows 4-6), the whole bias.
  assert restored.restored[("w", 0, 0)].shape == (3, 5)
  assert restored.restored[("w", 0, 1)].shape == (5,)
  slots = sharded.optimizers[1].momentums
  for u in range(2):
    for kind, keys in enumerate(restored._unit_keys(u)):  # pylint: disable=protected-access
      shard = restored._restored_shard(  # pylint: disable=protected-access
          u, [restored.restored[k] for k in keys], 1)
      held = sharded.shards[1][u] if kind == 0 else slots[u]
      np.testing.assert_array_equal(shard, held.numpy())
