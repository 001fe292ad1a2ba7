"""Peak memory and step time of fully sharded weights
(tfdist.sharded_params, ZeRO-3) against plain data parallelism, ZeRO-1
and one process's plain Keras training, for issue 46.

python -m tools.lab_sharded_params [--steps=6] [--batch=8] [--workers=2]
    [--modes=default,mwms,zero1,params,params_serial,params_kept]

The model of tools.bench_replica_memory (a 12-layer MLP of 2,900 units,
92.8M float32 weights) trains --steps steps of Adam on random batches of
--batch per process:
- default: one process, no strategy, Keras's own apply_gradients;
- mwms: --workers MultiWorkerMirrored workers on loopback, Keras's own
  apply_gradients (its all-reduce);
- zero1: the same with tfdist.sharded_optimizer (each worker 1/N of the
  Adam slots; the gradient reduce-scattered, the weights all-gathered);
- params: the weights sharded too (each worker 1/N of every layer's
  weights and Adam slots), the model's whole weights released once
  sharded;
- params_serial: params with no prefetch (each unit's gather waits for
  the unit before it to finish, in the backward for its reduce-scatter);
- params_kept: params with the whole weights kept.
Each is run again at width 16 and the growth is the difference of peak
RSS (VmHWM): what the model costs, not TF's start-up. Prints the highest
process's growth, its ratio to default's, and the median time of the
steps after the first (the highest process's).
"""

import argparse
import statistics
import sys
import time

from . import bench_replica_memory
from . import worker_pair

_MODES = ("default", "mwms", "zero1", "params", "params_serial",
          "params_kept")
_TINY = 16


def _default_step(tf, model, optimizer, loss_fn):
  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss
  return step


def _distributed_step(tf, keras, strategy, model, batch, mode):
  """The step of a multi-worker mode (see the module docstring)."""
  from tfdist import sharded_optimizer  # pylint: disable=g-import-not-at-top
  from tfdist import sharded_params  # pylint: disable=g-import-not-at-top
  adam = lambda: keras.optimizers.Adam(1e-4)  # noqa: E731
  if mode == "mwms":
    with strategy.scope():
      optimizer = adam()
      optimizer.build(model.trainable_variables)
  elif mode == "zero1":
    zero1 = sharded_optimizer.ShardedUpdate(
        strategy=strategy, variables=model.trainable_variables,
        make_optimizer=adam)
  else:
    sharded = sharded_params.ShardedParams(
        strategy=strategy, model=model, make_optimizer=adam,
        prefetch=mode != "params_serial",
        release_model_weights=mode != "params_kept")
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="sum")
  replicas = strategy.num_replicas_in_sync

  def replica_fn(x, y):
    with tf.GradientTape() as tape:
      if mode.startswith("params"):
        with sharded.gathering():
          logits = model(x, training=True)
      else:
        logits = model(x, training=True)
      loss = loss_fn(y, logits) / (batch * replicas)
    if mode == "mwms":
      optimizer.apply_gradients(zip(tape.gradient(
          loss, model.trainable_variables), model.trainable_variables))
    elif mode == "zero1":
      zero1.apply(tape.gradient(loss, model.trainable_variables))
    else:
      sharded.apply(tape.gradient(loss, sharded.variables()))
    return loss

  return tf.function(lambda x, y: strategy.run(replica_fn, args=(x, y)))


def worker(spec):
  """One process: prints its peak RSS (MB) after the steps and the
  median time of the steps after the first (ms)."""
  index, mode, width, steps, batch, ports = spec.split(",", 5)
  width, steps, batch = int(width), int(steps), int(batch)
  if mode != "default":
    worker_pair.set_tf_config(index, ports)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  strategy = (None if mode == "default"
              else tf.distribute.MultiWorkerMirroredStrategy())
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(int(index))
  x = tf.random.normal([batch, 8, 8, 1])
  y = tf.random.uniform([batch], 0, 10, tf.int32)
  if strategy is None:
    model = bench_replica_memory.mlp(width, f"mlp_{width}")
    step = _default_step(
        tf, model, keras.optimizers.Adam(1e-4),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  else:
    with strategy.scope():
      model = bench_replica_memory.mlp(width, f"mlp_{width}")
    step = _distributed_step(tf, keras, strategy, model, batch, mode)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    losses = step(x, y)
    loss = float(tf.add_n(strategy.experimental_local_results(losses))
                 if strategy else losses)
    times.append(time.perf_counter() - start)
  if not loss == loss:  # NaN
    raise AssertionError(f"the loss is {loss}")
  median = statistics.median(times[1:]) * 1000 if steps > 1 else 0.0
  peak = bench_replica_memory.status_mb("self", "VmHWM")
  print(f"peak {peak:.0f} {median:.1f}", flush=True)


def _peak(mode, width, steps, batch, workers):
  """The highest process's peak RSS (MB) and median step time (ms)."""
  count = 1 if mode == "default" else workers
  ports = worker_pair.ports(count)
  outs = worker_pair.run("tools.lab_sharded_params", [
      f"{i},{mode},{width},{steps},{batch},{ports}" for i in range(count)])
  return max(tuple(float(x) for x in out.split()[-2:]) for out in outs)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m tools.lab_sharded_params")
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--width", type=int, default=2900)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--modes", default=",".join(_MODES))
  parser.add_argument("--worker", default=None, help="(internal)")
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  if args.worker:
    worker(args.worker)
    return
  modes = args.modes.split(",")
  unknown = sorted(set(modes) - set(_MODES))
  if (unknown or args.steps < 1 or args.batch < 1 or args.width <= _TINY
      or args.workers < 2):
    parser.error(f"--modes from {list(_MODES)}, --steps >= 1, --batch >= 1,"
                 f" --width > {_TINY}, --workers >= 2. Received: "
                 f"modes={args.modes}, steps={args.steps}, batch={args.batch},"
                 f" width={args.width}, workers={args.workers}")
  growth = {}
  for mode in modes:
    peak, step_ms = _peak(mode, args.width, args.steps, args.batch,
                          args.workers)
    growth[mode] = peak - _peak(mode, _TINY, args.steps, args.batch,
                                args.workers)[0]
    ratio = (f", {growth[mode] / growth['default']:.2f}x default"
             if "default" in growth else "")
    print(f"{mode:13s} peak growth +{growth[mode]:,.0f} MB{ratio}; "
          f"step {step_ms:,.0f} ms", flush=True)


if __name__ == "__main__":
  main()
