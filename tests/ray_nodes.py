"""A local multi-node Ray cluster (ray.cluster_utils.Cluster) that a test
grows and shrinks while a job runs on it. Run it inside the test's network
namespace:

  python tests/ray_nodes.py CONTROL_DIR HEAD_CPUS

It writes CONTROL_DIR/address once the head is up. Then a file named
`add` in CONTROL_DIR adds a node with 1 CPU, `remove` removes the last
node added (its processes are killed: a host that is gone), and `stop`
ends the cluster. Each command is answered by a file `<command>.done`.
"""

import os
import sys
import time

from ray import cluster_utils


def main(control, head_cpus):
  cluster = cluster_utils.Cluster(
      initialize_head=True,
      head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
  with open(os.path.join(control, "address.tmp"), "w") as f:
    f.write(cluster.address)
  os.rename(os.path.join(control, "address.tmp"),
            os.path.join(control, "address"))
  added = []
  try:
    while True:
      for command in ("add", "remove", "stop"):
        path = os.path.join(control, command)
        if not os.path.exists(path):
          continue
        os.remove(path)
        if command == "add":
          added.append(cluster.add_node(num_cpus=1))
        elif command == "remove":
          cluster.remove_node(added.pop(), allow_graceful=False)
        else:
          return
        open(path + ".done", "w").close()
      time.sleep(0.2)
  finally:
    cluster.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
