"""TF_CONFIG: build, parse and validate, and the tools.tf_config CLI."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from tfdist import cluster
from tfdist.cluster import ClusterError


def _tf_config(cluster_dict, task_type="worker", index=0, **extra):
  return json.dumps({"cluster": cluster_dict,
                     "task": {"type": task_type, "index": index}, **extra})


def test_build_gives_every_task_its_config_and_isolates_the_evaluator():
  configs = cluster.build_tf_configs({
      "chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"],
      "ps": ["h3:2222"], "evaluator": ["h4:2222"]})
  assert sorted(configs) == [("chief", 0), ("evaluator", 0), ("ps", 0),
                             ("worker", 0), ("worker", 1)]
  training = {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"],
              "ps": ["h3:2222"]}
  assert configs[("worker", 1)] == {"cluster": training,
                                    "task": {"type": "worker", "index": 1}}
  # A PS job: the evaluator learns the ps count (how variables are split).
  assert configs[("evaluator", 0)] == {
      "cluster": {"evaluator": ["h4:2222"], **training},
      "task": {"type": "evaluator", "index": 0}}
  for key, config in configs.items():
    parsed = cluster.parse_tf_config(json.dumps(config))
    assert (parsed.task_type, parsed.task_index) == (key[0], config["task"]
                                                     ["index"])
  # Without ps (MWMS), the evaluator's TF_CONFIG holds only itself.
  mwms = cluster.build_tf_configs({"worker": ["h1:2222", "h2:2222"],
                                   "evaluator": ["h4:2222"]})
  assert mwms[("evaluator", 0)]["cluster"] == {"evaluator": ["h4:2222"]}


def test_hosts_with_base_port():
  assert cluster.addresses_from_hosts(["a", "b", "a"], 5000) == (
      "a:5000", "b:5000", "a:5001")


@pytest.mark.parametrize("raw,message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"cluster": {"worker": ["a:1"]}}), "has no task"),
    (_tf_config({"worker": ["a:1"]}, task_type="boss"),
     "Unrecognized task type: 'boss'"),
    (_tf_config({"master": ["a:1"]}), "Unrecognized task type in cluster"),
    (_tf_config({"worker": ["a:1", "b:1"]}, index=2),
     "task index 2 of 'worker' is not in the cluster"),
    (_tf_config({"worker": ["a:1", "a:1"]}), "duplicate address a:1"),
    (_tf_config({"worker": ["a:70000"]}), "port in 1..65535"),
    (_tf_config({"worker": ["a:0"]}), "port in 1..65535"),
    (_tf_config({"worker": ["nohost"]}), "must be host:port"),
    (_tf_config({"worker": ["a:1"], "ps": ["b:1"]}), "needs a chief"),
])
def test_bad_tf_config_is_named_in_one_line(raw, message):
  with pytest.raises(ClusterError, match=message) as info:
    cluster.parse_tf_config(raw)
  assert "\n" not in str(info.value)


def test_kubeflow_tfjob_shape_with_evaluator_and_environment():
  task = cluster.parse_tf_config(_tf_config(
      {"chief": ["job-chief-0:2222"], "worker": ["job-worker-0:2222"],
       "evaluator": ["job-evaluator-0:2222"]},
      task_type="worker", index=0, environment="cloud"))
  assert task.environment == "cloud"
  assert task.training_cluster == {"chief": {0: "job-chief-0:2222"},
                                   "worker": {0: "job-worker-0:2222"}}
  assert not task.is_chief and task.num_trainers == 2


def test_kubeflow_sparse_dynamic_worker_form():
  task = cluster.parse_tf_config(_tf_config(
      {"chief": ["c:1"], "worker": {"1": "w1:1"}}, index=1))
  assert task.address == "w1:1"
  assert task.cluster_as_lists() == {"chief": ["c:1"],
                                     "worker": {"1": "w1:1"}}
  with pytest.raises(ClusterError, match="task index 0"):
    cluster.parse_tf_config(_tf_config(
        {"chief": ["c:1"], "worker": {"1": "w1:1"}}, index=0))


def test_ray_train_worker_only_form():
  task = cluster.parse_tf_config(_tf_config(
      {"worker": ["ray-worker-0:2345", "ray-worker-1:2345"]}, index=0))
  assert task.is_chief and task.num_trainers == 2


def test_env_reader_takes_a_mapping():
  assert cluster.tf_config_from_env({}) is None
  task = cluster.tf_config_from_env(
      {"TF_CONFIG": _tf_config({"worker": ["a:1"]})})
  assert task.task_type == "worker"


def _tool(*args):
  return subprocess.run([sys.executable, "-m", "tools.tf_config", *args],
                        cwd=ROOT, capture_output=True, text=True)


def test_tf_config_cli_json_and_env():
  proc = _tool("--chief=h0:1000", "--workers=h1:1000,h2:1000",
               "--ps=h3:1000", "--evaluator=h4:1000")
  assert proc.returncode == 0, proc.stderr
  tasks = json.loads(proc.stdout)
  assert set(tasks) == {"chief:0", "worker:0", "worker:1", "ps:0",
                        "evaluator:0"}
  assert tasks["worker:1"]["task"] == {"type": "worker", "index": 1}
  proc = _tool("--workers=h1:1000,h2:1000", "--format=env")
  lines = proc.stdout.splitlines()
  exports = [l for l in lines if l.startswith("export TF_CONFIG=")]
  assert len(exports) == 2
  assert json.loads(exports[1].split("=", 1)[1].strip("'"))["task"] == {
      "type": "worker", "index": 1}


def test_tf_config_cli_bad_input_one_line():
  proc = _tool("--workers=h1:1000,h1:1000")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines() == [
      "tools.tf_config: error: duplicate address h1:1000 for worker:0 and "
      "worker:1"]
