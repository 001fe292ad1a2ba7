"""Times MultiWorkerMirrored all-reduces of given sizes (a lab task).

Started by tools.netlab --probe_sizes as every task of a lab job, with
TF_CONFIG set by the launcher. Worker 0 prints one line per size:
  probe bytes=S seconds=T
T is one ring all-reduce of S float32 bytes (one pack): the median over
--calls of a tf.function that runs --repeats all-reduces back to back, as
a training loop runs its steps, divided by --repeats. (Timed one Python
call each, the fitted per-message cost on the lab's 10 Gbit/s was about
ten times higher: mostly dispatch, which a training loop does not pay.)
"""

import statistics
import sys
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["65536", "1048576", "4194304"], "Bytes.")
flags.DEFINE_integer("repeats", 8, "All-reduces per timed call.")
flags.DEFINE_integer("calls", 3, "Timed calls per size (median).")


def main(argv):
  del argv
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
      communication_options=tf.distribute.experimental.CommunicationOptions(
          implementation=tf.distribute.experimental
          .CommunicationImplementation.RING))
  chief = strategy.cluster_resolver.task_id == 0
  for size in (int(s) for s in FLAGS.sizes):
    length = max(size // 4, 1)

    @tf.function
    def reduce_many(length=length):
      def replica_fn(previous):
        # Each all-reduce reads the last one's result, so they run in
        # order and none is pruned.
        values = tf.ones([length], tf.float32) + 0.0 * previous
        return tf.distribute.get_replica_context().all_reduce(
            "sum", tf.identity(values))
      total = tf.zeros([])
      for _ in tf.range(FLAGS.repeats):
        reduced = strategy.run(replica_fn, args=(total,))
        total = strategy.experimental_local_results(reduced)[0][0]
      return total

    reduce_many()  # Warm-up: tracing and connection set-up.
    times = []
    for _ in range(FLAGS.calls):
      start = time.perf_counter()
      reduce_many().numpy()
      times.append((time.perf_counter() - start) / FLAGS.repeats)
    if chief:
      print(f"probe bytes={size} seconds={statistics.median(times):.6f}",
            flush=True)
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
