"""Print each task's TF_CONFIG for a cluster.

python -m tools.tf_config --chief=h:p --workers=h1:p,h2:p [--ps=...]
    [--evaluator=h:p] [--format=json|env]

Or give hosts and a base port: --workers=h1,h2 --base_port=2222.
"""

import json
import sys

from absl import app
from absl import flags

from tfdist import cluster

FLAGS = flags.FLAGS
flags.DEFINE_list("chief", [], "The chief's host:port (at most one).")
flags.DEFINE_list("workers", [], "Workers' host:port list.")
flags.DEFINE_list("ps", [], "Parameter servers' host:port list.")
flags.DEFINE_list("evaluator", [], "The evaluator's host:port.")
flags.DEFINE_integer("base_port", None,
                     "With host-only lists: ports start here per host.")
flags.DEFINE_enum("format", "json", ["json", "env"],
                  "json: one object keyed role:index; env: export lines.")


def _addresses(values):
  if FLAGS.base_port is None or all(":" in v for v in values):
    return list(values)
  return list(cluster.addresses_from_hosts(values, FLAGS.base_port))


def render(configs, fmt):
  if fmt == "env":
    return "\n".join(cluster.to_env_lines(configs))
  return json.dumps({f"{role}:{index}": config
                     for (role, index), config in configs.items()},
                    indent=1)


def main(argv):
  if len(argv) > 1:
    sys.exit(f"tools.tf_config: error: unexpected arguments {argv[1:]}")
  description = {"chief": FLAGS.chief, "worker": FLAGS.workers,
                 "ps": FLAGS.ps, "evaluator": FLAGS.evaluator}
  try:
    configs = cluster.build_tf_configs(
        {role: _addresses(values) for role, values in description.items()})
  except cluster.ClusterError as e:
    sys.stderr.write(f"tools.tf_config: error: {e}\n")
    sys.exit(2)
  print(render(configs, FLAGS.format))


if __name__ == "__main__":
  app.run(main)
