"""Times MultiWorkerMirrored all-reduces of given sizes (a lab task).

Started by tools.netlab --probe as every task of a lab job, with TF_CONFIG
set by the launcher. Worker 0 prints one line per size:
  probe bytes=S seconds=T
T is the median over --repeats calls of one all-reduce of S float32 bytes
(ring, one pack), after a warm-up call.
"""

import statistics
import sys
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["65536", "1048576", "4194304"], "Bytes.")
flags.DEFINE_integer("repeats", 5, "Timed calls per size.")


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
    def reduce(length=length):
      def replica_fn():
        values = tf.ones([length], tf.float32)
        return tf.distribute.get_replica_context().all_reduce("sum", values)
      return strategy.run(replica_fn)

    reduce()  # Warm-up: tracing and connection set-up.
    times = []
    for _ in range(FLAGS.repeats):
      start = time.perf_counter()
      reduce().numpy()
      times.append(time.perf_counter() - start)
    if chief:
      print(f"probe bytes={size} seconds={statistics.median(times):.6f}",
            flush=True)
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
