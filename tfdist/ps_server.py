"""ps and worker tasks of a parameter-server job: serve until the chief is
done.

They run a tf.distribute.Server. There is no "job finished" RPC in TF, so
each server watches the chief's port: once the chief has been seen and then
stays unreachable, the job is over and the server exits 0.
"""

import socket
import time

from absl import logging
import tensorflow as tf

from tfdist import cluster as cluster_lib


def _reachable(address, timeout=1.0):
  host, port = cluster_lib.check_address(address)
  try:
    with socket.create_connection((host, port), timeout=timeout):
      return True
  except OSError:
    return False


def start_server(task):
  """Starts this task's server; call before any other TF op runs."""
  num_workers = len(task.cluster.get("worker", {}))
  # Fewer inter-op threads than workers + 1 deadlocks a 2-core machine.
  config = tf.compat.v1.ConfigProto(
      inter_op_parallelism_threads=max(num_workers + 1, 4))
  return tf.distribute.Server(
      tf.train.ClusterSpec(task.cluster_as_lists()),
      job_name=task.task_type, task_index=task.task_index, protocol="grpc",
      config=config, start=True)


def serve_until_chief_done(task, *, poll_seconds=1.0, misses_to_stop=3):
  chief = task.cluster["chief"][0]
  logging.info("Serving as %s:%d at %s until the chief (%s) is done.",
               task.task_type, task.task_index, task.address, chief)
  seen, misses = False, 0
  while True:
    if _reachable(chief):
      seen, misses = True, 0
    elif seen:
      misses += 1
      if misses >= misses_to_stop:
        logging.info("The chief is gone; %s:%d exits.", task.task_type,
                     task.task_index)
        return
    time.sleep(poll_seconds)
