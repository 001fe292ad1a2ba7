"""Slurm: TF_CONFIG from srun's environment (pure), and real jobs through
launch/slurm.sbatch on a real one-node slurmctld/slurmd."""

import os
import re
import sys

import pytest

import artifacts
import slurm_cluster
from conftest import ROOT
from conftest import long_test
from tfdist import cluster
from tfdist.cluster import ClusterError

# Kills processes, times out or owns a daemon: run alone (.ci/run).
pytestmark = pytest.mark.serial


def test_expand_hostlist():
  assert cluster.expand_hostlist("n[01-03,7],gpu5") == (
      "n01", "n02", "n03", "n7", "gpu5")
  assert cluster.expand_hostlist("localhost") == ("localhost",)
  assert cluster.expand_hostlist("a[1-2]-ib") == ("a1-ib", "a2-ib")


def _srun_env(rank, nodes="n[1-2]", per_node="2(x2)", tasks=4):
  return {"SLURM_STEP_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": per_node,
          "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_PROCID": str(rank),
          "SLURM_JOB_ID": "7"}


def test_slurm_roles_ports_and_chief():
  task = cluster.tf_config_from_slurm(_srun_env(3), ps_tasks=1,
                                      base_port=5000)
  assert task.cluster == {"ps": {0: "n1:5000"}, "chief": {0: "n1:5001"},
                          "worker": {0: "n2:5000", 1: "n2:5001"}}
  assert (task.task_type, task.task_index) == ("worker", 1)
  first = cluster.tf_config_from_slurm(_srun_env(0), base_port=5000)
  assert first.is_chief and first.task_type == "worker"
  derived = cluster.tf_config_from_slurm(_srun_env(1))
  assert derived.address == "n1:20008"  # 20000 + job id 7 + local id 1


def test_outside_srun_is_a_clear_error():
  with pytest.raises(ClusterError, match="must run under srun"):
    cluster.tf_config_from_slurm({"SLURM_JOB_NODELIST": "n1",
                                  "SLURM_PROCID": "0"})
  with pytest.raises(ClusterError, match="ps_tasks=3 for 3 tasks"):
    cluster.tf_config_from_slurm(_srun_env(0, tasks=3, per_node="3",
                                           nodes="n1"), ps_tasks=3)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
  if not slurm_cluster.available():
    pytest.skip("needs root and Debian's slurm-wlm + munge (.ci/run "
                "installs them)")
  with slurm_cluster.SlurmCluster(str(tmp_path_factory.mktemp("slurm"))) as c:
    # sbatch exports the submit environment: this python is the one used.
    c.env["PATH"] = (os.path.dirname(sys.executable) + os.pathsep +
                     c.env["PATH"])
    yield c


@pytest.mark.parametrize("strategy,extra", [
    ("multi_worker_mirrored", []),
    ("parameter_server", ["--ps_tasks=1"]),
], ids=["mwms", "ps"])
def test_sbatch_job_completes(slurm, strategy, extra, tmp_path, data_dir):
  """The PS job trains on a tf.data service (TFDIST_DATA_WORKERS=1: a
  dispatcher and a data worker as job steps of their own, 2 more tasks)."""
  if strategy == "multi_worker_mirrored":
    # The PS job runs the same sbatch script with more roles; MWMS through
    # a launcher is tested in test_multi_worker.py and test_ray.py.
    long_test("45-75 s")
  served = strategy == "parameter_server"
  model_dir = str(tmp_path / "run")
  code, output = slurm.sbatch(
      ["-N1", "-n5" if served else "-n3",
       *(["--export=ALL,TFDIST_DATA_WORKERS=1"] if served else []),
       "launch/slurm.sbatch", f"--strategy={strategy}",
       *extra, f"--model_dir={model_dir}", f"--data_dir={data_dir}",
       "--train_steps=60", "--steps_per_loop=10", "--eval_every=0",
       "--batch_size=48"],
      cwd=ROOT)
  assert code == 0, output[-3000:]
  assert "Finished at step 60/60" in output
  assert artifacts.checkpoint_step(model_dir) == 60
  if served:
    assert re.search(r"Input: tf.data service grpc://localhost:\d+ "
                     r"\(dynamic\), job \S+\.", output), output[-3000:]


def test_a_data_service_given_beside_data_workers_is_one_line(slurm,
                                                              tmp_path):
  """TFDIST_DATA_WORKERS passes the service's address: a --data_service of
  the user's would override it, silently."""
  model_dir = tmp_path / "never"
  code, output = slurm.sbatch(
      ["-N1", "-n3", "--export=ALL,TFDIST_DATA_WORKERS=1",
       "launch/slurm.sbatch", "--data_service", "grpc://elsewhere:1",
       f"--model_dir={model_dir}"], cwd=ROOT, timeout=120)
  assert code != 0
  errors = [l for l in output.splitlines()
            if "drop --data_service from the train flags" in l]
  assert len(errors) == 1, output[-2000:]
  assert errors[0].startswith("launch/slurm.sbatch: error: ")
  assert "Traceback" not in output
  assert not model_dir.exists()
