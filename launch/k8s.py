"""Kubernetes manifests for a tfdist job, printed as YAML.

python -m launch.k8s --name=JOB --image=IMAGE [--chief] --workers=N
    [--ps=M] [--evaluator] [--gpus_per_worker=G] [--cpu=2] [--memory=4Gi]
    [--namespace=NS] [--port=2222] [--volume=pvc:CLAIM:/mount ...]
    [--data_workers=K] [--format=jobs|tfjob] [--output=FILE]
    -- <tfdist.train flags>

--format=jobs (default) writes, for `kubectl apply -f`:
- a headless Service whose name is the pods' subdomain, so task i of a role
  is reachable as <job>-<role>-<i>.<job>:<port>;
- one Indexed Job per role (completions = parallelism = replicas,
  restartPolicy OnFailure, a backoffLimit). Each pod computes its TF_CONFIG
  at start from its role and JOB_COMPLETION_INDEX with launch.task_config;
- a NetworkPolicy that admits the training port only from pods of the same
  job: TF's gRPC servers have no authentication.
--format=tfjob writes a Kubeflow TFJob; its operator sets TF_CONFIG.

--data_workers=K adds, in either format, a tf.data service: a dispatcher
Deployment (one pod, its journal in an emptyDir that outlives a container
restart) behind a Service <job>-dispatcher, and a Deployment of K data
workers, each advertising its pod IP and mounting every --volume (they
read the train files); the trainers get
--data_service=grpc://<job>-dispatcher:DISPATCHER_PORT, and the
NetworkPolicy admits the service's ports from the job's pods.

Both formats mount every --volume in every pod: a model_dir inside the
container's own filesystem is lost when the container restarts, and a
sidecar evaluator in another pod never sees it, so a local model_dir on
no volume gets a warning (gs:// and s3:// need none).
"""

import argparse
import dataclasses
import json
import posixpath
import re
import shlex
import sys

import yaml

from . import arguments
from . import data_service
from . import description

ROLE_LABEL = "tfdist.dev/role"
JOB_LABEL = "tfdist.dev/job"
TFJOB_ROLES = {"chief": "Chief", "worker": "Worker", "ps": "PS",
               "evaluator": "Evaluator"}
DISPATCHER_PORT, DATA_WORKER_PORT = 5050, 5051
DISPATCHER_WORK_DIR = "/tfdist-dispatcher"
DISPATCHER_WAIT_SECONDS = 600


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m launch.k8s")
  description.add_arguments(parser)
  parser.add_argument("--name", required=True, help="Job name (DNS label).")
  parser.add_argument("--image", required=True, help="Container image.")
  parser.add_argument("--namespace", default=None)
  parser.add_argument("--port", type=int, default=2222)
  parser.add_argument("--gpus_per_worker", type=int, default=0)
  parser.add_argument("--cpu", default=None, help="CPU request and limit.")
  parser.add_argument("--memory", default=None,
                      help="Memory request and limit, e.g. 4Gi.")
  parser.add_argument("--backoff_limit", type=int, default=6,
                      help="Pod restarts a Job allows before it fails.")
  parser.add_argument("--volume", action="append", default=[],
                      metavar="KIND:SOURCE:MOUNT",
                      help="Mount a volume in every pod, repeatable: "
                      "pvc:CLAIM:/mount, hostPath:/node/path:/mount, or "
                      "emptyDir:/mount (single-pod tests only).")
  description.add_data_workers_argument(parser)
  parser.add_argument("--format", choices=("jobs", "tfjob"), default="jobs")
  parser.add_argument("--output", default=None, help="Write here, not "
                      "stdout.")
  parser.add_argument("train_args", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  if args.train_args[:1] == ["--"]:
    args.train_args = args.train_args[1:]
  # Room for "-<role>-<index>" in a 63-character pod hostname.
  if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", args.name):
    parser.error(f"--name must be a lowercase DNS label of at most 40 "
                 f"characters. Received: {args.name!r}")
  try:
    args.cluster = description.from_args(args)
    args.volumes = [parse_volume(v) for v in args.volume]
  except ValueError as e:
    parser.error(str(e))
  if args.cluster.data_workers:
    arguments.check_no_data_service(parser, args.train_args)
    # The dispatcher's pod starts with the trainers' (image pull, import).
    wait = ([] if arguments.given_train_flag(args.train_args,
                                         "data_service_wait")
            else [f"--data_service_wait={DISPATCHER_WAIT_SECONDS}"])
    args.train_args = [*args.train_args,
                       f"--data_service={dispatcher_address(args)}", *wait]
  warning = model_dir_warning(args.train_args, args.volumes)
  if warning:
    sys.stderr.write(f"python -m launch.k8s: warning: {warning}\n")
  return args


@dataclasses.dataclass(frozen=True)
class Volume:
  kind: str  # pvc, hostPath or emptyDir
  source: str  # claim name or node path; "" for emptyDir
  mount: str


def parse_volume(text):
  kind, _, rest = text.partition(":")
  if kind == "emptyDir":
    source, mount = "", rest
  elif kind in ("pvc", "hostPath"):
    source, _, mount = rest.rpartition(":")
  else:
    raise ValueError(f"--volume kind must be pvc, hostPath or emptyDir. "
                     f"Received: --volume={text}")
  if not mount.startswith("/") or (kind != "emptyDir" and not source):
    raise ValueError(f"--volume must be pvc:CLAIM:/mount, "
                     f"hostPath:/path:/mount or emptyDir:/mount. Received: "
                     f"--volume={text}")
  return Volume(kind=kind, source=source, mount=mount.rstrip("/") or "/")


def model_dir_warning(train_args, volumes):
  """Why the checkpoints would be lost, or None: a local model_dir must
  live on a volume (gs:// and s3:// are read through tf.io.gfile)."""
  model_dir = arguments.given_train_flag(train_args, "model_dir")
  if not model_dir or "://" in model_dir:
    return None
  path = posixpath.normpath(model_dir)
  if any(path == v.mount or path.startswith(v.mount.rstrip("/") + "/")
         for v in volumes):
    return None
  return (f"--model_dir={model_dir} is on no --volume: a restarted "
          "container loses its checkpoints, and an evaluator in another pod "
          "never sees them. Mount one (--volume=pvc:CLAIM:/mount) or use a "
          "gs:// or s3:// model_dir.")


def _pod_volumes(args):
  """(pod `volumes`, container `volumeMounts`) for --volume."""
  volumes, mounts = [], []
  for i, volume in enumerate(args.volumes):
    name = f"volume-{i}"
    source = {"pvc": {"persistentVolumeClaim": {"claimName": volume.source}},
              "hostPath": {"hostPath": {"path": volume.source,
                                        "type": "DirectoryOrCreate"}},
              "emptyDir": {"emptyDir": {}}}[volume.kind]
    volumes.append({"name": name, **source})
    mounts.append({"name": name, "mountPath": volume.mount})
  return volumes, mounts


def addresses(args):
  """Stable pod DNS names: <job>-<role>-<index>.<service>:<port>."""
  return {role: [f"{args.name}-{role}-{i}.{args.name}:{args.port}"
                 for i in range(count)]
          for role, count in args.cluster.counts().items()}


def dispatcher_address(args):
  return f"grpc://{args.name}-dispatcher:{DISPATCHER_PORT}"


def _deployment(args, role, replicas, container, **pod_fields):
  labels = {JOB_LABEL: args.name, ROLE_LABEL: role}
  return {
      "apiVersion": "apps/v1", "kind": "Deployment",
      "metadata": _metadata(args, f"{args.name}-{role.replace('_', '-')}",
                            role),
      "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
               "template": {"metadata": {"labels": labels},
                            "spec": {**pod_fields,
                                     "containers": [container]}}}}


def service_manifests(args):
  """The tf.data service's Service and Deployments (--data_workers). The
  data workers read the train files: they mount every --volume, as the
  trainers do."""
  count = args.cluster.data_workers
  if not count:
    return []
  argv = data_service.commands(
      python=["python"], port=DISPATCHER_PORT, host=f"{args.name}-dispatcher",
      work_dir=DISPATCHER_WORK_DIR, data_workers=1,
      module=data_service.REMOTE_MODULE, worker_address="auto",
      worker_port=DATA_WORKER_PORT)
  dispatcher = _container(args, "dispatcher", name="dispatcher",
                          command=argv["dispatcher"], port_name="dispatcher",
                          port=DISPATCHER_PORT)
  dispatcher["volumeMounts"] = [*dispatcher.get("volumeMounts", []),
                                {"name": "journal",
                                 "mountPath": DISPATCHER_WORK_DIR}]
  worker = _container(args, "data_worker", name="data-worker",
                      command=argv["data_worker:0"], port_name="data-worker",
                      port=DATA_WORKER_PORT)
  volumes, _ = _pod_volumes(args)
  return [
      {"apiVersion": "v1", "kind": "Service",
       "metadata": _metadata(args, f"{args.name}-dispatcher", "dispatcher"),
       "spec": {"selector": {JOB_LABEL: args.name,
                             ROLE_LABEL: "dispatcher"},
                "ports": [{"name": "dispatcher", "port": DISPATCHER_PORT,
                           "targetPort": DISPATCHER_PORT}]}},
      _deployment(args, "dispatcher", 1, dispatcher, volumes=[
          *volumes, {"name": "journal", "emptyDir": {}}]),
      _deployment(args, "data_worker", count, worker,
                  **({"volumes": volumes} if volumes else {}))]


def _metadata(args, name, role=None):
  labels = {JOB_LABEL: args.name}
  if role:
    labels[ROLE_LABEL] = role
  meta = {"name": name, "labels": labels}
  if args.namespace:
    meta["namespace"] = args.namespace
  return meta


def _resources(args, role):
  amounts = {}
  if args.cpu:
    amounts["cpu"] = args.cpu
  if args.memory:
    amounts["memory"] = args.memory
  limits = dict(amounts)
  if args.gpus_per_worker and role in ("chief", "worker"):
    limits["nvidia.com/gpu"] = args.gpus_per_worker
  resources = {}
  if amounts:
    resources["requests"] = amounts
  if limits:
    resources["limits"] = limits
  return resources


def start_script(train_args):
  """The container command: TF_CONFIG from role and index, then train."""
  # A bare assignment takes the exit status of its $(...): a bad cluster
  # stops the pod here instead of starting TF without a TF_CONFIG.
  return ('TF_CONFIG="$(python -m tfdist.launch.task_config '
          '--cluster "$TFDIST_CLUSTER" --role "$TFDIST_ROLE" '
          '--index "$JOB_COMPLETION_INDEX")" && export TF_CONFIG && '
          'exec python -m tfdist.train '
          + " ".join(shlex.quote(a) for a in train_args))


def _container(args, role, *, name, command, port_name, env=None,
               port=None):
  """One pod's container; both formats and the tf.data service build
  theirs here, so the job's environment (GRPC_FAIL_FAST for PS jobs) and
  volumes reach every pod."""
  env = dict(env or {}, **description.role_env(args.cluster))
  container = {
      "name": name, "image": args.image, "command": command,
      "ports": [{"name": port_name, "containerPort": port or args.port}],
  }
  if env:
    container["env"] = [{"name": k, "value": v} for k, v in env.items()]
  resources = _resources(args, role)
  if resources:
    container["resources"] = resources
  _, mounts = _pod_volumes(args)
  if mounts:
    container["volumeMounts"] = mounts
  return container


def _pod_spec(args, container, **fields):
  spec = {**fields, "containers": [container]}
  volumes, _ = _pod_volumes(args)
  if volumes:
    spec["volumes"] = volumes
  return spec


def job_manifests(args):
  cluster_json = json.dumps(addresses(args), separators=(",", ":"))
  docs = [{
      "apiVersion": "v1", "kind": "Service",
      "metadata": _metadata(args, args.name),
      "spec": {"clusterIP": "None", "selector": {JOB_LABEL: args.name},
               # TF tasks must resolve each other before they are ready.
               "publishNotReadyAddresses": True,
               "ports": [{"name": "grpc", "port": args.port,
                          "targetPort": args.port}]},
  }]
  for role, count in args.cluster.counts().items():
    docs.append({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": _metadata(args, f"{args.name}-{role}", role),
        "spec": {
            "completionMode": "Indexed", "completions": count,
            "parallelism": count, "backoffLimit": args.backoff_limit,
            "template": {
                "metadata": {"labels": {JOB_LABEL: args.name,
                                        ROLE_LABEL: role}},
                "spec": _pod_spec(
                    args, _container(
                        args, role, name="tfdist",
                        command=["sh", "-c", start_script(args.train_args)],
                        port_name="grpc",
                        env={"TFDIST_CLUSTER": cluster_json,
                             "TFDIST_ROLE": role}),
                    subdomain=args.name, restartPolicy="OnFailure"),
            },
        },
    })
  docs.append({
      "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
      "metadata": _metadata(args, f"{args.name}-grpc"),
      "spec": {"podSelector": {"matchLabels": {JOB_LABEL: args.name}},
               "policyTypes": ["Ingress"],
               "ingress": [{"from": [{"podSelector": {"matchLabels": {
                   JOB_LABEL: args.name}}}],
                            "ports": [{"protocol": "TCP", "port": port}
                                      for port in _job_ports(args)]}]},
  })
  return docs + service_manifests(args)


def _job_ports(args):
  if args.cluster.data_workers:
    return [args.port, DISPATCHER_PORT, DATA_WORKER_PORT]
  return [args.port]


def tfjob_manifest(args):
  specs = {}
  for role, count in args.cluster.counts().items():
    # Kubeflow's operator finds the container named "tensorflow".
    container = _container(
        args, role, name="tensorflow",
        command=["python", "-m", "tfdist.train", *args.train_args],
        port_name="tfjob-port")
    specs[TFJOB_ROLES[role]] = {
        "replicas": count, "restartPolicy": "OnFailure",
        "template": {"spec": _pod_spec(args, container)}}
  return [{"apiVersion": "kubeflow.org/v1", "kind": "TFJob",
           "metadata": _metadata(args, args.name),
           "spec": {"runPolicy": {"backoffLimit": args.backoff_limit},
                    "tfReplicaSpecs": specs}}] + service_manifests(args)


def render(args):
  docs = job_manifests(args) if args.format == "jobs" else tfjob_manifest(
      args)
  return yaml.safe_dump_all(docs, sort_keys=False)


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  text = render(args)
  if args.output:
    with open(args.output, "w") as f:
      f.write(text)
  else:
    sys.stdout.write(text)


if __name__ == "__main__":
  main()
