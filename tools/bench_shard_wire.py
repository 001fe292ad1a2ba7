"""Bytes on the wire: reduce-scatter + all-gather (tfdist.collectives),
and a step of fully sharded weights (tfdist.sharded_params), against one
all-reduce of the same buffer, for MultiWorkerMirrored.

sudo python -m tools.bench_shard_wire [--workers=2] [--floats=1000000]
    [--short=20] [--long=60] [--rounds=3]

Each job runs in a fresh network namespace with only `lo`, so its loopback
counter sees only that job. A job is --workers processes that each run K
exchanges of a float32 buffer of --floats elements: either the strategy's
all-reduce (ring), or tfdist's all-to-all reduce-scatter followed by the
all-gather of the shards, the pair a sharded optimizer sends per step,
or (`params`) the forward and backward of one layer whose --floats
weights are sharded: gathered for the forward, gathered again for the
backward, the gradient reduce-scattered (1.5x the ring's bytes); or
(`params_kept`) the same with reshard off: the forward's gathered weights
kept for the backward (1.0x).
Jobs of --short and --long exchanges cancel start-up: the difference in
bytes over the difference in K is the cost of one exchange. Loopback
counts each packet once: bytes per worker = total / workers. Prints each
round and the median ratio to the all-reduce [min-max]; the ring bound is 2(N-1)/N x the
buffer. Needs root and iproute2.
"""

import argparse
import statistics
import sys

from . import worker_pair
from .bench_allreduce import Namespace

_MODES = ("all_reduce", "sharded", "params", "params_kept")


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m tools.bench_shard_wire")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--floats", type=int, default=1_000_000)
  parser.add_argument("--short", type=int, default=20)
  parser.add_argument("--long", type=int, default=60)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--worker", default=None,
                      help="(internal) index,mode,exchanges,ports")
  args = parser.parse_args(argv)
  if args.workers < 2 or args.floats < 1 or not 0 < args.short < args.long:
    parser.error(f"need --workers >= 2, --floats >= 1 and 0 < --short < "
                 f"--long. Received: workers={args.workers}, floats="
                 f"{args.floats}, short={args.short}, long={args.long}")
  return args


def worker(spec, floats):
  """One worker process: `exchanges` exchanges of the buffer."""
  index, mode, exchanges, ports = spec.split(",", 3)
  worker_pair.set_tf_config(index, ports)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist import collectives  # pylint: disable=g-import-not-at-top
  from tfdist import flat_layout  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
      communication_options=tf.distribute.experimental.CommunicationOptions(
          implementation=tf.distribute.experimental.CommunicationImplementation.RING))
  shards = collectives.ShardCollectives(strategy, length=floats)
  exchange = (_params_step(tf, strategy, floats, reshard=mode == "params")
              if mode.startswith("params") else
              _exchange(tf, strategy, mode, shards, flat_layout, floats))
  workers = len(ports.split(":"))
  for k in range(int(exchanges)):
    total = float(exchange(tf.constant(float(k))))
    expected = k * workers * floats
    if total != expected:
      raise AssertionError(f"exchange {k} summed to {total}, not {expected}")


def _exchange(tf, strategy, mode, shards, flat_layout, floats):
  @tf.function
  def exchange(scale):
    def replica_fn():
      values = tf.ones([floats]) * scale
      if mode == "all_reduce":
        return tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, values)
      return shards.all_gather(shards.reduce_scatter(
          lambda start, end: flat_layout.read_range([values], [floats],
                                                    start, end)))
    return tf.reduce_sum(strategy.experimental_local_results(
        strategy.run(replica_fn))[0])
  return exchange


def _params_step(tf, strategy, floats, reshard):
  """The forward and backward of a layer of `floats` sharded weights (1
  input, `floats` outputs, no bias): the sum of the summed gradient (the
  input is `scale`, so every weight's gradient is `scale` on each
  replica), from every replica's shard by one scalar all-reduce (a few
  bytes beside the weights')."""
  import keras  # pylint: disable=g-import-not-at-top
  from tfdist import sharded_params  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(
        floats, use_bias=False, kernel_initializer="ones")])
  sharded = sharded_params.ShardedParams(
      strategy=strategy, model=model,
      make_optimizer=lambda: keras.optimizers.SGD(0.0), reshard=reshard)

  @tf.function
  def step(scale):
    def replica_fn():
      with tf.GradientTape() as tape:
        with sharded.gathering():
          loss = tf.reduce_sum(model(tf.reshape(scale, [1, 1])))
      [grad] = tape.gradient(loss, sharded.variables())
      return tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.SUM, tf.reduce_sum(grad))
    return strategy.experimental_local_results(strategy.run(replica_fn))[0]
  return step


def _job(ns, workers, mode, exchanges, floats):
  """Loopback bytes of one job."""
  ports = worker_pair.ports(workers)
  before = ns.tx_bytes()
  worker_pair.run("tools.bench_shard_wire", [
      f"{i},{mode},{exchanges},{ports}" for i in range(workers)],
                  args=[f"--floats={floats}"],
                  prefix=["ip", "netns", "exec", ns.name], timeout=600)
  return ns.tx_bytes() - before


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.worker:
    worker(args.worker, args.floats)
    return
  n = args.workers
  bound = 2 * (n - 1) / n * 4 * args.floats
  print(f"{n} workers, a float32 buffer of {args.floats} elements "
        f"({4 * args.floats / 1e6:.1f} MB), jobs of {args.short} and "
        f"{args.long} exchanges; ring bound {bound:.0f} bytes/worker.")
  ratios = {}
  with Namespace() as ns:
    for k in range(args.rounds):
      per_worker = {}
      for mode in _MODES:  # Interleaved, round by round.
        short, long_ = (_job(ns, n, mode, steps, args.floats)
                        for steps in (args.short, args.long))
        per_worker[mode] = (long_ - short) / (args.long - args.short) / n
      ring = per_worker["all_reduce"]
      for mode in _MODES[1:]:
        ratios.setdefault(mode, []).append(per_worker[mode] / ring)
      print(f"round {k + 1}: all-reduce {ring:.0f} ({ring / bound:.3f} of "
            f"the bound), reduce-scatter + all-gather "
            f"{per_worker['sharded']:.0f} ({per_worker['sharded'] / ring:.3f}"
            f"x), sharded weights' step {per_worker['params']:.0f} "
            f"({per_worker['params'] / ring:.3f}x), kept "
            f"{per_worker['params_kept']:.0f} "
            f"({per_worker['params_kept'] / ring:.3f}x) bytes/worker",
            flush=True)
  for mode, values in ratios.items():
    print(f"{mode} / all-reduce, median [min-max] of {args.rounds}: "
          f"{statistics.median(values):.3f} [{min(values):.3f}-"
          f"{max(values):.3f}]")


if __name__ == "__main__":
  main()
