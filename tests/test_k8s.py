"""Kubernetes manifests: schema-valid (kubernetes-validate, pinned), and
each pod's start command, run locally with the environment its Indexed Job
would give it and hostnames mapped to 127.0.0.1 ports, trains to the end."""

import io
import json
import os
import shutil
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
VOLUMES = ["--volume=pvc:tfdist-runs:/data", "--volume=emptyDir:/scratch",
           "--volume=hostPath:/srv/datasets:/datasets"]


@pytest.mark.parametrize("argv", [MWMS, PS], ids=["mwms", "ps"])
def test_manifests_pass_schema_validation(argv, capsys):
  docs = _manifests(*argv, *VOLUMES, "--", "--strategy=auto",
                    "--model_dir=/data/r")
  assert "warning" not in capsys.readouterr().err
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
    _assert_volumes(spec["template"]["spec"])
  service = docs[0]["spec"]
  assert service["clusterIP"] == "None"
  policy = docs[-1]["spec"]
  assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == \
      service["selector"]


def _assert_volumes(pod_spec):
  assert pod_spec["volumes"] == [
      {"name": "volume-0", "persistentVolumeClaim": {
          "claimName": "tfdist-runs"}},
      {"name": "volume-1", "emptyDir": {}},
      {"name": "volume-2", "hostPath": {"path": "/srv/datasets",
                                        "type": "DirectoryOrCreate"}}]
  assert pod_spec["containers"][0]["volumeMounts"] == [
      {"name": "volume-0", "mountPath": "/data"},
      {"name": "volume-1", "mountPath": "/scratch"},
      {"name": "volume-2", "mountPath": "/datasets"}]


@pytest.mark.parametrize("model_dir,warned", [
    ("/data/run", False), ("/data", False), ("gs://bucket/run", False),
    ("s3://bucket/run", False), ("/database/run", True), ("runs/x", True)])
def test_a_model_dir_on_no_volume_is_warned_about(model_dir, warned, capsys):
  k8s.parse_args(["--name=j", "--image=i", "--workers=1",
                  "--volume=pvc:c:/data", "--", f"--model_dir={model_dir}"])
  err = capsys.readouterr().err
  assert ("is on no --volume: a restarted container loses its "
          "checkpoints" in err) is warned, err


@pytest.mark.parametrize("volume", ["nfs:server:/d", "pvc:/d", "pvc:c:d",
                                    "hostPath::/d", "emptyDir:d"])
def test_bad_volume_is_one_line(volume, capsys):
  with pytest.raises(SystemExit):
    k8s.parse_args(["--name=j", "--image=i", "--workers=1",
                    f"--volume={volume}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("python -m launch.k8s: error: --volume")


@pytest.mark.parametrize("form", ["jobs", "tfjob"])
def test_a_data_service_is_schema_valid_and_wired_to_the_trainers(form):
  """--data_workers: a dispatcher behind its Service, data workers that
  find it and advertise their pod IP, trainers told its address."""
  docs = _manifests(*MWMS, *VOLUMES, "--data_workers=3", f"--format={form}",
                    "--", "--strategy=multi_worker_mirrored",
                    "--model_dir=/data/r")
  by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
  service = by_name["Service", "mwms-dispatcher"]
  workers = by_name["Deployment", "mwms-data-worker"]
  deployments = [d for d in docs if d["kind"] == "Deployment"]
  assert {d["metadata"]["name"] for d in deployments} == {
      "mwms-dispatcher", "mwms-data-worker"}
  for doc in docs:
    if doc["kind"] != "TFJob":
      kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
  dispatcher = next(d for d in deployments
                    if d["metadata"]["name"] == "mwms-dispatcher")
  assert dispatcher["spec"]["replicas"] == 1
  assert workers["spec"]["replicas"] == 3
  pod = dispatcher["spec"]["template"]
  assert service["spec"]["selector"] == pod["metadata"]["labels"]
  (container,) = pod["spec"]["containers"]
  assert f"--port={k8s.DISPATCHER_PORT}" in container["command"]
  assert {"name": "journal", "mountPath": k8s.DISPATCHER_WORK_DIR} in \
      container["volumeMounts"]
  (worker,) = workers["spec"]["template"]["spec"]["containers"]
  assert f"--dispatcher=mwms-dispatcher:{k8s.DISPATCHER_PORT}" in \
      worker["command"]
  assert f"--port={k8s.DATA_WORKER_PORT}" in worker["command"]
  assert "--worker_address=auto" in worker["command"]
  # The data workers read the train files: every volume, as the trainers.
  _assert_volumes(workers["spec"]["template"]["spec"])
  address = f"--data_service=grpc://mwms-dispatcher:{k8s.DISPATCHER_PORT}"
  if form == "jobs":
    trainer = by_name["Job", "mwms-worker"]["spec"]["template"]["spec"][
        "containers"][0]
    assert address in trainer["command"][-1]
    (rule,) = by_name["NetworkPolicy", "mwms-grpc"]["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == {
        2222, k8s.DISPATCHER_PORT, k8s.DATA_WORKER_PORT}
  else:
    trainer = by_name["TFJob", "mwms"]["spec"]["tfReplicaSpecs"]["Worker"][
        "template"]["spec"]["containers"][0]
    assert address in trainer["command"]


def test_a_data_service_given_twice_is_one_line(capsys):
  with pytest.raises(SystemExit):
    k8s.parse_args([*MWMS, "--data_workers=1", "--",
                    "--data_service=grpc://elsewhere:1"])
  (error,) = [l for l in capsys.readouterr().err.splitlines()
              if "error:" in l]
  assert "drop --data_service from the train flags" in error


def test_tfjob_format_is_valid_where_kubernetes_can_check_it():
  (tfjob,) = _manifests(*PS, *VOLUMES, "--format=tfjob", "--",
                        "--strategy=parameter_server", "--model_dir=/data/r")
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
    _assert_volumes(spec["template"]["spec"])
    env = spec["template"]["spec"]["containers"][0]["env"]
    assert {"name": "GRPC_FAIL_FAST", "value": "use_caller"} in env


def test_bad_name_is_one_line():
  with pytest.raises(SystemExit):
    k8s.parse_args(["--name=Bad_Name", "--image=x", "--workers=1"])


def _with_mounts(pod_spec, command):
  """The pod's command in a private mount namespace (unshare, as root)
  where each hostPath volume is bind-mounted at its mountPath, as the
  kubelet would."""
  sources = {v["name"]: v["hostPath"]["path"]
             for v in pod_spec.get("volumes", []) if "hostPath" in v}
  binds = [(sources[m["name"]], m["mountPath"])
           for m in pod_spec["containers"][0].get("volumeMounts", [])]
  if not binds:
    return command
  script = " && ".join(f"mkdir -p {src} && mount --bind {src} {dst}"
                       for src, dst in binds)
  return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
          script + ' && exec "$@"', "pod", *command]


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
          argv=_with_mounts(job["spec"]["template"]["spec"],
                            container["command"]),
          env={**env, "JOB_COMPLETION_INDEX": str(index), "PATH": path}))
  return specs


@pytest.mark.parametrize("argv,train", [
    (MWMS, ["--strategy=multi_worker_mirrored"]),
    (PS, ["--strategy=parameter_server"]),
], ids=["mwms", "ps"])
def test_pod_commands_train_to_completion(argv, train, tmp_path, data_dir):
  """With model_dir on a hostPath volume: every pod sees the node's
  directory at the mount path, as on a cluster."""
  if os.geteuid() != 0 or not shutil.which("unshare"):
    pytest.skip("needs root and unshare to mount the pods' volume")
  node, mount = tmp_path / "node", tmp_path / "pod"
  mount.mkdir()
  model_dir = str(mount / "run")
  docs = _manifests(*argv, f"--volume=hostPath:{node}:{mount}", "--", *train,
                    f"--model_dir={model_dir}",
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
  # The checkpoints are on the node's volume; nothing under the mount
  # point outside the pods.
  assert artifacts.checkpoint_step(str(node / "run")) == 60
  assert not os.listdir(mount)
  if "--evaluator" in argv:
    assert "Sidecar evaluator done at step 60" in out.getvalue()


def test_dockerfile_installs_what_the_manifests_run():
  """No image can be built here (no registry for base images), so check
  what can be: every COPY source exists, the extras exist in setup.cfg,
  and the pod command's modules are in the packages the image installs."""
  with open(os.path.join(ROOT, "Dockerfile")) as f:
    lines = [l.split("#")[0].strip() for l in f]
  copied = [l.split()[1] for l in lines if l.startswith("COPY ")]
  for source in copied:
    assert os.path.exists(os.path.join(ROOT, source)), source
  with open(os.path.join(ROOT, "setup.cfg")) as f:
    setup = f.read()
  extras = [l.split("=", 1)[1] for l in lines
            if l.startswith("ARG TF_EXTRA=")]
  assert extras == ["cpu"] and "\ncpu =\n" in setup and "\ngpu =\n" in setup
  # launch -> tfdist.launch (package_dir), which the pod command imports.
  assert {"tfdist", "models", "launch", "tools"} <= set(copied)
  assert "python -m tfdist.launch.task_config" in k8s.start_script([])
