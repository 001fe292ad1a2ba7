"""launch.ssh against a real sshd on 127.0.0.1 with key auth made here."""

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
