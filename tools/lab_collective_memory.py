"""Whether TF keeps memory for each collective op of a traced step: RSS
of a MultiWorkerMirrored worker after steps of all-reduces, for issue
46's "where does a replica's memory go".

python -m tools.lab_collective_memory [--packs=12] [--mib=32] [--calls=4]

Two worker processes on loopback (ports from portpicker) each run a
traced step of --packs all-reduces of --mib MiB, one after another
(each waits for the one before), --calls times, in three ways:
- `unrolled`: one all-reduce op per pack, of floats made from the step's
  argument, as a training step sends its gradient packs
  (tfdist.compression.PlainReducer);
- `unrolled_constants`: the same, of floats made from constants only
  (kept about a pack's bytes per op: TF's graph optimizer, we infer,
  folds each fill into a constant the traced function keeps);
- `one_instance`: one all-reduce op in a while loop, run once per pack.
Each is also run with one pack, to take away what any collective costs
(gRPC channels, TF's threads). Prints, for worker 0, the RSS growth after
the last call over the RSS before the first, and per extra pack in
multiples of a pack's bytes; and the growth again after glibc's
malloc_trim(0), which hands back every free page: what is left is
memory in use, not malloc's free lists.
"""

import argparse
import sys

from . import bench_replica_memory
from . import worker_pair

_MODES = ("unrolled", "unrolled_constants", "one_instance")


def _step(tf, strategy, mode, packs, length):
  """The traced step: `packs` all-reduces of `length` floats in turn,
  the floats made from the step's argument (as gradients are), or, for
  `unrolled_constants`, from constants only."""
  from tensorflow.python.ops import collective_ops  # pylint: disable=g-import-not-at-top
  launcher = strategy.extended._cross_device_ops._launchers[0]  # pylint: disable=protected-access

  def unrolled(scale):
    context, total, last = tf.distribute.get_replica_context(), 0.0, []
    for p in range(packs):
      with tf.control_dependencies(last):
        values = tf.fill([length], float(p + 1) * (
            1.0 if mode == "unrolled_constants" else scale))
      last = [context.all_reduce(tf.distribute.ReduceOp.SUM, values)]
      total += last[0][0]
    return total

  def one_instance(scale):
    key = launcher._next_instance_key()  # pylint: disable=protected-access

    def body(p, total):
      values = tf.fill([length], tf.cast(p + 1, tf.float32) * scale)
      with tf.device(launcher._device):  # pylint: disable=protected-access
        summed = collective_ops.all_reduce_v2(
            values, launcher._group_size, launcher._group_key, key,  # pylint: disable=protected-access
            ordering_token=launcher._get_ordering_token())  # pylint: disable=protected-access
      return p + 1, total + summed[0]
    return tf.while_loop(lambda p, _: p < packs, body,
                         (tf.constant(0), tf.constant(0.0)),
                         parallel_iterations=1)[1]
  replica_fn = one_instance if mode == "one_instance" else unrolled
  return tf.function(lambda scale: strategy.run(replica_fn, args=(scale,)))


def worker(spec):
  """One worker: prints its RSS growth after the last call (one local
  replica, as the lab starts it)."""
  index, mode, packs, mib, calls, ports = spec.split(",", 5)
  worker_pair.set_tf_config(index, ports)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  packs, workers = int(packs), len(ports.split(":"))
  step = _step(tf, strategy, mode, packs, (int(mib) << 20) // 4)
  before = bench_replica_memory.status_mb("self", "VmRSS")
  for _ in range(int(calls)):
    total = float(step(tf.constant(1.0)))
  expected = workers * packs * (packs + 1) / 2
  if total != expected:
    raise AssertionError(f"the all-reduces summed to {total}, not {expected}")
  grown = bench_replica_memory.status_mb("self", "VmRSS") - before
  import ctypes  # pylint: disable=g-import-not-at-top
  ctypes.CDLL("libc.so.6").malloc_trim(0)
  trimmed = bench_replica_memory.status_mb("self", "VmRSS") - before
  print(f"growth {grown:.0f} {trimmed:.0f}", flush=True)


def _job(mode, packs, mib, calls):
  """Worker 0's RSS growth (MiB), before and after the trim."""
  ports = worker_pair.ports()
  outs = worker_pair.run("tools.lab_collective_memory", [
      f"{i},{mode},{packs},{mib},{calls},{ports}" for i in range(2)],
                         timeout=600)
  return [float(x) for x in outs[0].split()[-2:]]


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m tools.lab_collective_memory")
  parser.add_argument("--packs", type=int, default=12)
  parser.add_argument("--mib", type=int, default=32)
  parser.add_argument("--calls", type=int, default=4)
  parser.add_argument("--worker", default=None, help="(internal)")
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  if args.worker:
    worker(args.worker)
    return
  if args.packs < 2 or args.mib < 1 or args.calls < 1:
    parser.error(f"need --packs >= 2, --mib >= 1, --calls >= 1. Received: "
                 f"packs={args.packs}, mib={args.mib}, calls={args.calls}")
  print(f"2 workers, {args.calls} calls of a step of {args.packs} "
        f"all-reduces of {args.mib} MiB; worker 0's RSS growth:")
  for mode in _MODES:
    (one, one_trim), (many, many_trim) = (
        _job(mode, packs, args.mib, args.calls) for packs in (1, args.packs))
    print(f"  after malloc_trim(0): 1 pack +{one_trim:.0f} MiB, "
          f"{args.packs} packs +{many_trim:.0f} MiB")
    per_pack = (many - one) / (args.packs - 1) / args.mib
    print(f"  {mode:12s} 1 pack +{one:.0f} MiB, {args.packs} packs "
          f"+{many:.0f} MiB: {per_pack:.2f}x a pack's bytes per extra pack",
          flush=True)


if __name__ == "__main__":
  main()
