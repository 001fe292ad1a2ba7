"""Shared fixtures: the CLI as a subprocess, and prepared digits data."""

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A non-interactive shell starts a background job (`bash .ci/run &`) with
# SIGINT ignored, every process the tests start inherits that, and a
# launcher leaves an ignored signal alone (as under nohup): the Ctrl-C
# tests then wait on a job that never stops. The tests need SIGINT as a
# terminal gives it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)

# In-process tests get 4 logical CPUs (tensor-parallel layers need several);
# this must happen before anything starts the TF runtime.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 4)


def long_test(why):
  """Skips a test that CI cannot afford (it must stay under 25 minutes)
  unless TFDIST_LONG_TESTS=1."""
  if not os.environ.get("TFDIST_LONG_TESTS"):
    pytest.skip(f"long test ({why}): set TFDIST_LONG_TESTS=1")


def user_project(tmp_path, module, name):
  """A directory outside the repository holding only the user's module:
  tests/`module` copied as `name`, so a run imports it from its cwd."""
  path = tmp_path / "project"
  path.mkdir()
  shutil.copy(os.path.join(ROOT, "tests", module), path / name)
  return path


def warm_starts(output):
  """{attempt: tasks started on a warm spare that was waiting}: a task
  whose pid the launcher's last "warm spares waiting" line listed."""
  waiting, warm = [], {}
  for line in output.splitlines():
    if "warm spares waiting for a restart's tasks: pids " in line:
      waiting = [int(p) for p in line.split("pids ")[1].split(", ") if p]
    started = re.search(r"started \S+ pid=(\d+) .*\(attempt (\d+), a warm "
                        r"spare\)", line)
    if started and int(started.group(1)) in waiting:
      attempt = int(started.group(2))
      warm[attempt] = warm.get(attempt, 0) + 1
  return warm


def run_cli(*args, timeout=300, env=None, check=True):
  """Runs `python -m tfdist.train ARGS`; returns the CompletedProcess."""
  proc = subprocess.run(
      [sys.executable, "-m", "tfdist.train", *args], cwd=ROOT,
      capture_output=True, text=True, timeout=timeout,
      env={**os.environ, **(env or {})})
  if check and proc.returncode != 0:
    raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n"
                         f"{proc.stderr}")
  return proc


@pytest.fixture(scope="session")
def two_cpu_strategy():
  """The process's one MirroredStrategy over /cpu:0 and /cpu:1. In-process
  tests share it: a second such strategy reuses the first one's collective
  instance keys, and its all-reduce fails (InternalError) once the first
  has run one (pytest-xdist puts any test files in one process)."""
  return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """digits prepared once for the whole session, through the CLI path."""
  path = str(tmp_path_factory.mktemp("tfds"))
  subprocess.run([sys.executable, "-c",
                  "import sys; from tfdist import digits; "
                  "digits.prepare(sys.argv[1])", path],
                 cwd=ROOT, check=True, capture_output=True)
  return path


def process_alive(pid):
  """True while `pid` runs; a zombie has exited, only its parent has not
  reaped it yet."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def run_launcher(launcher_args, train_args, *, timeout=600, check=True):
  """Runs `python -m launch.local LAUNCHER_ARGS -- TRAIN_ARGS`."""
  proc = subprocess.run(
      [sys.executable, "-m", "launch.local", *launcher_args, "--",
       *train_args], cwd=ROOT, capture_output=True, text=True,
      timeout=timeout)
  if check and proc.returncode != 0:
    raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n"
                         f"{proc.stderr}")
  return proc


class LauncherProcess:
  """A launcher run whose output is read line by line while it runs."""

  def __init__(self, launcher_args, train_args, env=None,
               module="launch.local", prefix=(), cwd=ROOT):
    self.lines = []
    self.pids = {}
    self.proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", module, *launcher_args, "--",
         *train_args], cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})})

  def wait_for(self, predicate, timeout=300):
    """Reads lines until one satisfies `predicate`; returns it."""
    import time
    deadline = time.monotonic() + timeout
    for line in self.proc.stdout:
      self.lines.append(line)
      if line.startswith("[launch] started "):
        name, pid = line.split()[2], int(line.split("pid=")[1].split()[0])
        self.pids[name] = pid
      if predicate(line):
        return line
      if time.monotonic() > deadline:
        break
    raise AssertionError("never saw the expected line:\n" +
                         "".join(self.lines[-60:]))

  def finish(self, timeout=600):
    try:
      rest, _ = self.proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      # SIGINT first: the launcher then stops every task it started.
      self.proc.send_signal(2)
      rest, _ = self.proc.communicate(timeout=60)
      raise AssertionError(f"still running after {timeout}s:\n" + "".join(
          self.lines[-40:]) + rest[-3000:]) from None
    self.lines.append(rest)
    return self.proc.returncode, "".join(self.lines)


@pytest.fixture
def gce_metadata():
  """A fake GCE metadata server on loopback: "host:port" for
  GCE_METADATA_IP. With it, TensorFlow believes it runs on a GCE VM (its
  preemption handler asks the server, as on GCE and GKE nodes)."""
  import http.server
  import threading

  class Metadata(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # pylint: disable=invalid-name
      body = (b"NONE" if self.path.endswith("maintenance-event")
              else b"tfdist-test-vm")
      self.send_response(200)
      self.send_header("Metadata-Flavor", "Google")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  address = f"127.0.0.1:{server.server_address[1]}"
  # The test's premise: TensorFlow's own check says "on GCP".
  check = subprocess.run(
      [sys.executable, "-c", "from tensorflow.python.distribute."
       "failure_handling import failure_handling_util as u; "
       "print(u.on_gcp())"], capture_output=True, text=True, timeout=120,
      env={**os.environ, "GCE_METADATA_IP": address})
  assert check.stdout.strip().endswith("True"), check.stdout + check.stderr
  try:
    yield address
  finally:
    server.shutdown()


@pytest.fixture
def netns():
  """A network namespace with only loopback up, as an `ip netns exec`
  prefix; removed afterwards. Ray run there falls back to 127.0.0.1."""
  if os.geteuid() != 0 or not shutil.which("ip"):
    pytest.skip("needs root and iproute2 for a private network namespace")
  name = f"tfdist-ray-{os.getpid()}"
  subprocess.run(["ip", "netns", "add", name], check=True)
  try:
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo",
                    "up"], check=True)
    yield ["ip", "netns", "exec", name]
  finally:
    subprocess.run(["ip", "netns", "del", name], check=False)
