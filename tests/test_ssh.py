"""launch.ssh against a real sshd on 127.0.0.1 with key auth made here."""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import portpicker
import pytest

import artifacts
import test_elastic
from conftest import LauncherProcess
from conftest import warm_starts
from conftest import ROOT

# Kills processes, times out or owns a daemon: run alone (.ci/run).
pytestmark = pytest.mark.serial

SSHD_CONFIG = """\
ListenAddress 127.0.0.1
Port {port}
HostKey {root}/host_key
AuthorizedKeysFile {root}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile {root}/sshd.pid
"""


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
  if os.geteuid() != 0 or not shutil.which("sshd"):
    pytest.skip("needs root and Debian's openssh-server (.ci/run installs "
                "it)")
  root = str(tmp_path_factory.mktemp("sshd"))
  for name in ("host_key", "client_key"):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                    os.path.join(root, name)], check=True)
  shutil.copy(os.path.join(root, "client_key.pub"),
              os.path.join(root, "authorized_keys"))
  port = portpicker.pick_unused_port()
  with open(os.path.join(root, "sshd_config"), "w") as f:
    f.write(SSHD_CONFIG.format(root=root, port=port))
  os.makedirs("/run/sshd", exist_ok=True)  # Privilege separation dir.
  server = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f",
                             os.path.join(root, "sshd_config")],
                            stderr=subprocess.PIPE)
  ssh_args = (f"-p {port} -i {root}/client_key -o BatchMode=yes "
              "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
              "-o LogLevel=ERROR")
  for _ in range(50):
    if subprocess.run(["ssh", *ssh_args.split(), "127.0.0.1", "true"],
                      capture_output=True).returncode == 0:
      break
    time.sleep(0.2)
  else:
    server.kill()
    pytest.fail("sshd did not come up")
  yield ssh_args
  server.terminate()
  server.wait(timeout=10)


def _launch(ssh_args, model_dir, data_dir, *extra, launcher=()):
  return [sys.executable, "-m", "launch.ssh", "--hosts=127.0.0.1,127.0.0.1",
          f"--port={portpicker.pick_unused_port()}", f"--ssh_args={ssh_args}",
          f"--workdir={ROOT}", f"--python={sys.executable}", *launcher, "--",
          "--strategy=multi_worker_mirrored", f"--model_dir={model_dir}",
          f"--data_dir={data_dir}", "--steps_per_loop=10", "--eval_every=0",
          *extra]


def test_two_workers_over_ssh_train_to_the_end(sshd, tmp_path, data_dir):
  model_dir = str(tmp_path / "run")
  proc = subprocess.run(_launch(sshd, model_dir, data_dir,
                                "--train_steps=60"),
                        cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert re.search(r"worker:0 \| .*Finished at step 60/60", proc.stdout)
  assert "worker:1 | " in proc.stdout
  assert artifacts.checkpoint_step(model_dir) == 60


def test_a_tf_data_service_on_named_hosts(sshd, tmp_path, data_dir):
  """--data_workers over ssh: a dispatcher and 2 data workers on the named
  host, which the 2 trainers read in round-robin to the end."""
  model_dir = str(tmp_path / "run")
  port = portpicker.pick_unused_port()
  proc = subprocess.run(
      _launch(sshd, model_dir, data_dir, "--train_steps=60",
              launcher=["--data_workers=2", "--data_hosts=127.0.0.1",
                        f"--dispatcher_port={port}"]),
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert "a dispatcher and 2 data workers" in proc.stdout
  assert re.search(rf"worker:0 \| .*Input: tf.data service grpc://127.0.0.1:"
                   rf"{port} \(dynamic\), job \S+, 2 trainers in "
                   "round-robin", proc.stdout), proc.stdout[-3000:]
  assert "data_worker:1 | data worker serving" in proc.stdout
  assert artifacts.checkpoint_step(model_dir) == 60
  # The remote service processes ended with their sessions (this job's:
  # its port; other tests may run services of their own meanwhile).
  left = subprocess.run(["pgrep", "-f", f"^{sys.executable} -m "
                         f"tfdist.launch.data_service .*[=:]{port}( |$)"],
                        capture_output=True, text=True).stdout
  assert not left.split()


def _remote_pids(marker):
  """Training processes (started by sshd), not the ssh clients."""
  out = subprocess.run(["pgrep", "-f", f"^{sys.executable} -m tfdist.train "
                        f".*{marker}"], capture_output=True, text=True).stdout
  return [int(p) for p in out.split()]


def test_ctrl_c_stops_the_remote_processes(sshd, tmp_path, data_dir):
  model_dir = str(tmp_path / "ctrl_c_run")
  launcher = subprocess.Popen(
      _launch(sshd, model_dir, data_dir, "--train_steps=1000000",
              "--checkpoint_every=0", launcher=["--stop_grace_seconds=5"]),
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  for line in launcher.stdout:
    if "train step" in line:
      break
  assert len(_remote_pids(model_dir)) == 2
  launcher.send_signal(signal.SIGINT)
  launcher.communicate(timeout=60)
  assert launcher.returncode == 128 + signal.SIGINT
  deadline = time.monotonic() + 20
  while _remote_pids(model_dir) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert _remote_pids(model_dir) == []


def _listening_pid(port):
  """The process that listens on 127.0.0.1:`port` (a remote task's
  server: a task that began as a warm spare runs as `-m launch.spare`)."""
  out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"],
                       capture_output=True, text=True).stdout
  pids = set(re.findall(r"pid=(\d+)", out))
  assert len(pids) == 1, out
  return int(pids.pop())


def _spare_pids():
  out = subprocess.run(["pgrep", "-f", f"^{sys.executable} -m "
                        "tfdist.launch.spare"],
                       capture_output=True, text=True).stdout
  return [int(p) for p in out.split()]


def _scratch_dirs():
  """The tasks' TMPDIRs and non-chief scratch model_dirs in /tmp (the
  host's over ssh is this machine's)."""
  return set(glob.glob("/tmp/tfdist-ssh-*") +
             glob.glob("/tmp/tfdist-worker*"))


def test_elastic_job_grows_and_shrinks_with_discovery(sshd, tmp_path,
                                                      data_dir):
  """Discovery offers 2 slots, then 3: the job grows at a checkpoint.
  Then a host's slot goes and its worker dies: the job carries on with
  2. Every membership trains the weights one device would. Each change
  hands tasks to the host's warm spares (auto: one per task), and none
  outlives the launcher."""
  slots = tmp_path / "slots"
  slots.write_text("127.0.0.1:2\n")
  model_dir = tmp_path / "run"
  steps = 600  # Room for two changes before the last step.
  scratch_before = _scratch_dirs()
  run = LauncherProcess(
      ["--workers=2:3", f"--host_discovery=cat {slots}",
       "--discovery_seconds=0.5", f"--port={portpicker.pick_unused_port()}",
       f"--ssh_args={sshd}", f"--workdir={ROOT}",
       f"--python={sys.executable}", "--max_restarts=0",
       "--backoff_seconds=0.2", "--stop_grace_seconds=5"],
      [*test_elastic.train_args(model_dir, data_dir, steps),
       "--strategy=multi_worker_mirrored"], module="launch.ssh")
  run.wait_for(lambda l: l.startswith("worker:0") and "ckpt-20." in l)
  slots.write_text("127.0.0.1:3\n")
  started = run.wait_for(lambda l: "started worker:2 pid=" in l)
  run.wait_for(lambda l: l.startswith("worker:2") and "train step" in l)
  slots.write_text("127.0.0.1:2\n")
  port = int(re.search(r" at 127\.0\.0\.1:(\d+) ", started).group(1))
  os.kill(_listening_pid(port), signal.SIGKILL)
  code, output = run.finish()
  assert code == 0, output[-3000:]
  # Each change handed tasks to spares that were waiting (their pids on
  # the launcher's last "warm spares waiting" line): 2 of the 3 tasks of
  # the grown group (a third spare started for it then), both tasks of
  # the shrunk one.
  warm = warm_starts(output)
  assert warm == {2: 2, 3: 2}, (warm, output[-3000:])
  deadline = time.monotonic() + 30  # A spare may still be importing.
  while _spare_pids() and time.monotonic() < deadline:
    time.sleep(0.2)
  assert _spare_pids() == []
  assert "discovery offers 2 worker slot(s): starting with 2" in output
  assert "membership change: 2 -> 3 workers" in output
  # The resize's SIGTERM reached the remote tasks (not ssh's SIGHUP): the
  # group saved its step, and the new group resumed from it.
  saved = re.findall(r"worker:0 \| .*checkpoint saved at step (\d+)",
                     output)
  assert saved, output[-3000:]
  assert (f"Resumed from {model_dir}/ckpt-{saved[0]} at step {saved[0]}"
          in output), output[-3000:]
  assert "membership change: 3 -> 2 workers" in output, output[-3000:]
  assert f"worker:0 | Finished at step {steps}/{steps}" in output
  sizes = [v for _, v in artifacts.scalars(
      str(model_dir / "train"), "workers", in_time_order=True)]
  assert sizes == [2, 3, 2]
  test_elastic.assert_one_device_weights(model_dir, tmp_path, data_dir,
                                         steps)
  # The killed worker's scratch model_dir was in the tasks' TMPDIR on its
  # host, which the launcher removed at its end.
  assert _scratch_dirs() <= scratch_before
