"""Kubernetes manifests: schema-valid (kubernetes-validate, pinned), and
each pod's start command, run locally with the environment its Indexed Job
would give it and hostnames mapped to 127.0.0.1 ports, trains to the end."""

import io
import json
import os
import sys

import kubernetes_validate
import portpicker
import pytest
import yaml

import artifacts
from conftest import ROOT
from tfdist.launch import description
from tfdist.launch import k8s
from tfdist.launch import processes

KUBERNETES_VERSION = "1.30"


def _manifests(*argv):
  return list(yaml.safe_load_all(k8s.render(k8s.parse_args(list(argv)))))


MWMS = ["--name=mwms", "--image=tfdist:latest", "--workers=2", "--cpu=1",
        "--memory=2Gi", "--gpus_per_worker=1", "--namespace=ml"]
PS = ["--name=ps-job", "--image=tfdist:latest", "--chief", "--workers=1",
      "--ps=1", "--evaluator"]


@pytest.mark.parametrize("argv", [MWMS, PS], ids=["mwms", "ps"])
def test_manifests_pass_schema_validation(argv):
  docs = _manifests(*argv, "--", "--strategy=auto", "--model_dir=/data/r")
  kinds = [d["kind"] for d in docs]
  assert kinds[0] == "Service" and kinds[-1] == "NetworkPolicy"
  for doc in docs:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
  jobs = [d for d in docs if d["kind"] == "Job"]
  for job in jobs:
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] >= 1
    assert spec["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert spec["template"]["spec"]["subdomain"] == docs[0]["metadata"][
        "name"]
  service = docs[0]["spec"]
  assert service["clusterIP"] == "None"
  policy = docs[-1]["spec"]
  assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == \
      service["selector"]


def test_tfjob_format_is_valid_where_kubernetes_can_check_it():
  (tfjob,) = _manifests(*PS, "--format=tfjob", "--",
                        "--strategy=parameter_server")
  assert tfjob["kind"] == "TFJob"
  assert set(tfjob["spec"]["tfReplicaSpecs"]) == {"Chief", "Worker", "PS",
                                                  "Evaluator"}
  for spec in tfjob["spec"]["tfReplicaSpecs"].values():
    # TFJob is a CRD; its pod templates are core objects.
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "PodTemplate",
         "metadata": {"name": "check"}, "template": spec["template"]},
        KUBERNETES_VERSION, strict=True)
    assert spec["template"]["spec"]["containers"][0]["name"] == "tensorflow"


def test_bad_name_is_one_line():
  with pytest.raises(SystemExit):
    k8s.parse_args(["--name=Bad_Name", "--image=x", "--workers=1"])


def _local_pods(docs):
  """TaskSpecs that run each pod's command as a local process."""
  jobs = [d for d in docs if d["kind"] == "Job"]
  cluster = json.loads(next(e["value"] for e in jobs[0]["spec"]["template"][
      "spec"]["containers"][0]["env"] if e["name"] == "TFDIST_CLUSTER"))
  local = {role: [f"127.0.0.1:{portpicker.pick_unused_port()}"
                  for _ in hosts] for role, hosts in cluster.items()}
  path = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
  specs = []
  for job in jobs:
    container = job["spec"]["template"]["spec"]["containers"][0]
    role = job["metadata"]["labels"][k8s.ROLE_LABEL]
    env = {e["name"]: e["value"] for e in container["env"]}
    env["TFDIST_CLUSTER"] = json.dumps(local)
    for index in range(job["spec"]["completions"]):
      specs.append(description.TaskSpec(
          role=role, index=index, address=local[role][index],
          argv=container["command"],
          env={**env, "JOB_COMPLETION_INDEX": str(index), "PATH": path}))
  return specs


@pytest.mark.parametrize("argv,train", [
    (MWMS, ["--strategy=multi_worker_mirrored"]),
    (PS, ["--strategy=parameter_server"]),
], ids=["mwms", "ps"])
def test_pod_commands_train_to_completion(argv, train, tmp_path, data_dir):
  model_dir = str(tmp_path / "run")
  docs = _manifests(*argv, "--", *train, f"--model_dir={model_dir}",
                    f"--data_dir={data_dir}", "--train_steps=60",
                    "--steps_per_loop=10", "--eval_every=0")
  out = io.StringIO()
  job = processes.Job(_local_pods(docs), out=out, grace_seconds=5)
  cwd = os.getcwd()
  os.chdir(ROOT)  # The image's working directory holds the packages.
  try:
    job.start()
    code, failed = job.wait()
  finally:
    job.stop()
    os.chdir(cwd)
  assert code == 0, (failed and failed.name, out.getvalue()[-3000:])
  assert artifacts.checkpoint_step(model_dir) == 60
  if "--evaluator" in argv:
    assert "Sidecar evaluator done at step 60" in out.getvalue()
