"""Print one task's TF_CONFIG, for a container start command.

python -m launch.task_config --cluster='{"worker": ["h0:2222", ...]}' \
    --role=worker --index=$JOB_COMPLETION_INDEX

The cluster is the whole job's {role: [host:port]}; the TF_CONFIG comes
from tfdist.cluster.build_tf_configs, like every launcher's.
"""

import argparse
import json
import sys

from tfdist import cluster


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m launch.task_config")
  parser.add_argument("--cluster", required=True,
                      help="JSON {role: [host:port, ...]} of the whole job.")
  parser.add_argument("--role", required=True, choices=cluster.ROLES)
  parser.add_argument("--index", required=True, type=int)
  args = parser.parse_args(argv)
  try:
    configs = cluster.build_tf_configs(json.loads(args.cluster))
  except (json.JSONDecodeError, cluster.ClusterError) as e:
    sys.exit(f"launch.task_config: error: {e}")
  if (args.role, args.index) not in configs:
    sys.exit(f"launch.task_config: error: no task {args.role}:{args.index} "
             "in the cluster")
  print(json.dumps(configs[(args.role, args.index)], separators=(",", ":")))


if __name__ == "__main__":
  main()
