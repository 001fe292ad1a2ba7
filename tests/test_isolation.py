"""Training ports closed to the network: launch.local runs its tasks in a
private network namespace (as root), so a connection from outside the job
cannot reach a task's port; with --isolate=off it can.

"Outside" is a network namespace this test makes, joined to the host by a
veth pair with addresses from 198.18.0.0/15; the test connects from there
to the host end of the veth, and nowhere else.
"""

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import LauncherProcess
from launch import isolation

# Kills processes, times out or owns a daemon: run alone (.ci/run).
pytestmark = pytest.mark.serial


def _addresses(pid):
  """A /30 of 198.19.0.0/16 of this test's own, so that a veth left by a
  killed run cannot answer for it."""
  base = (pid % 16384) * 4
  return (f"198.19.{base // 256}.{base % 256 + 1}",
          f"198.19.{base // 256}.{base % 256 + 2}")


HOST, OUTSIDE = _addresses(os.getpid())


def _ip(*args, netns=None):
  prefix = ["ip", "netns", "exec", netns] if netns else []
  subprocess.run([*prefix, "ip", *args], check=True, capture_output=True)


@pytest.fixture
def outside():
  if os.geteuid() != 0 or not shutil.which("ip"):
    pytest.skip("needs root and iproute2 for network namespaces")
  # Named as a launcher's namespace is, so remove_stale deletes it when a
  # killed run left it behind.
  isolation.remove_stale()
  name = f"tfdist-{os.getpid()}-out"
  host_end, far_end = f"tfh{os.getpid() % 100000}", f"tfo{os.getpid() % 100000}"
  subprocess.run(["ip", "netns", "add", name], check=True)
  try:
    _ip("link", "add", host_end, "type", "veth", "peer", "name", far_end)
    _ip("link", "set", far_end, "netns", name)
    _ip("addr", "add", f"{HOST}/30", "dev", host_end)
    _ip("link", "set", host_end, "up")
    _ip("addr", "add", f"{OUTSIDE}/30", "dev", far_end, netns=name)
    _ip("link", "set", far_end, "up", netns=name)
    _ip("link", "set", "lo", "up", netns=name)
    yield name
  finally:
    subprocess.run(["ip", "netns", "del", name], check=False)
    subprocess.run(["ip", "link", "del", host_end], check=False,
                   capture_output=True)


def _reachable_from(netns, port):
  code = ("import socket; socket.create_connection(('%s', %d), timeout=3)"
          % (HOST, port))
  return subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c",
                         code], capture_output=True,
                        timeout=60).returncode == 0


@pytest.mark.parametrize("isolate,reachable", [("off", True), ("on", False)])
def test_task_ports_are_closed_to_the_outside(outside, tmp_path, data_dir,
                                             isolate, reachable):
  run = LauncherProcess(
      ["--workers=2", f"--isolate={isolate}"],
      ["--strategy=multi_worker_mirrored", "--train_steps=100000",
       "--steps_per_loop=10", "--log_every=100", "--eval_every=0",
       "--checkpoint_every=0", f"--data_dir={data_dir}",
       f"--model_dir={tmp_path / 'run'}"])
  run.wait_for(lambda l: "train step 100/100000" in l)
  started = "".join(l for l in run.lines if "started worker:1" in l)
  port = int(re.search(r"at 127\.0\.0\.1:(\d+)", started).group(1))
  assert _reachable_from(outside, port) is reachable
  run.proc.send_signal(signal.SIGINT)
  code, output = run.finish()
  assert code == 128 + signal.SIGINT, output[-2000:]
  if isolate == "on":
    assert "private network namespace" in output
    assert f"tfdist-{run.proc.pid}" not in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_namespaces_of_killed_launchers_are_removed():
  """A SIGKILLed launcher cannot delete its namespace; the next one does."""
  if os.geteuid() != 0 or not shutil.which("ip"):
    pytest.skip("needs root and iproute2 for network namespaces")
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()
  # A launcher's, and a network lab's (tools.netlab).
  stale = [f"tfdist-{gone.pid}", f"tfdist-{gone.pid}-lab-br"]
  live = [f"tfdist-{os.getpid()}", f"tfdist-{os.getpid()}-lab-t0"]
  for name in stale + live:
    subprocess.run(["ip", "netns", "add", name], check=True)
  try:
    isolation.remove_stale()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True,
                            text=True, check=True).stdout.split()
    assert not set(stale) & set(listed)
    assert set(live) <= set(listed)
  finally:
    for name in stale + live:
      subprocess.run(["ip", "netns", "del", name], capture_output=True)
