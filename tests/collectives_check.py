"""Checks tfdist.collectives on a real strategy and prints one line.

python tests/collectives_check.py mirrored N     # N logical CPUs
python tests/collectives_check.py multi_worker   # under a TF_CONFIG

Every replica holds its own random float32 vector of an odd length (so
the last shard is padded). The shard each replica gets from
reduce_scatter must be its rank's slice of the all-reduced sum, and the
all-gather of the shards must be that whole sum, on every replica.
"""

import sys

import numpy as np
import tensorflow as tf

from tfdist import collectives

LENGTH = 1001


def main(kind, replicas):
  if kind == "mirrored":
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    strategy = collectives.mirrored_with_collectives(
        [f"/cpu:{i}" for i in range(replicas)])
  else:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
  shards = collectives.ShardCollectives(strategy, length=LENGTH)

  @tf.function
  def check():
    def replica_fn():
      context = tf.distribute.get_replica_context()
      mine = tf.random.stateless_normal(
          [LENGTH], seed=[7, context.replica_id_in_sync_group])
      total = context.all_reduce(tf.distribute.ReduceOp.SUM, mine)
      shard = shards.reduce_scatter(mine)
      rank = shards.rank()
      padded = tf.pad(total, [[0, shards.shard_size * shards.num_shards -
                               LENGTH]])
      expected = tf.reshape(padded, [shards.num_shards, -1])[rank]
      return (tf.reduce_max(tf.abs(shard - expected)),
              tf.reduce_max(tf.abs(shards.all_gather(shard) - total)),
              rank)
    return strategy.run(replica_fn)

  shard_error, gather_error, ranks = (
      strategy.experimental_local_results(x) for x in check())
  worst = max(float(np.max(e)) for e in (*shard_error, *gather_error))
  assert worst < 1e-5, f"max error {worst}"
  print(f"collectives ok: {shards.num_shards} replicas, shard_size "
        f"{shards.shard_size}, ranks {[int(r) for r in ranks]}, max error "
        f"{worst:.2g}")


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
