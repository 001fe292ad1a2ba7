"""A private network namespace for a local job's gRPC traffic.

TF's gRPC servers listen on every interface and have no authentication:
anyone who can reach a task's port can run TensorFlow ops in it. As root,
launch.local runs all its tasks inside one network namespace of its own,
with only `lo` up, so the job's ports are reachable from nowhere else.
Without root it says so once and runs on the host network, as before.
"""

import os
import shutil
import subprocess


class PrivateNetwork:
  """`ip netns` namespace for one launcher: wrap() prefixes a command so it
  runs inside; close() deletes the namespace."""

  def __init__(self, name):
    self.name = name
    subprocess.run(["ip", "netns", "add", name], check=True,
                   capture_output=True)
    try:
      subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo",
                      "up"], check=True, capture_output=True)
    except subprocess.CalledProcessError:
      self.close()
      raise

  def wrap(self, argv):
    return ["ip", "netns", "exec", self.name, *argv]

  def close(self):
    subprocess.run(["ip", "netns", "del", self.name], check=False,
                   capture_output=True)


PREFIX = "tfdist-"  # Then the pid of the process that made it.


def remove_stale():
  """Deletes the namespaces of launchers (and network labs) that were
  SIGKILLed, and so could not delete their own: tfdist-<pid> and
  tfdist-<pid>-* whose pid is gone."""
  listed = subprocess.run(["ip", "netns", "list"], capture_output=True,
                          text=True, check=False).stdout
  for line in listed.splitlines():
    name = line.split()[0] if line.split() else ""
    pid = name[len(PREFIX):].split("-")[0]
    if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(
        f"/proc/{pid}"):
      subprocess.run(["ip", "netns", "del", name], check=False,
                     capture_output=True)


def available():
  """(True, '') if a private namespace can be made here, else (False,
  why)."""
  if os.geteuid() != 0:
    return False, "needs root (ip netns)"
  if not shutil.which("ip"):
    return False, "needs iproute2's ip"
  return True, ""


def open_for(mode, log):
  """A PrivateNetwork for --isolate=on|auto, or None (off, or auto where
  it cannot be made: said once)."""
  if mode == "off":
    return None
  ok, why = available()
  if not ok:
    if mode == "on":
      raise RuntimeError(f"--isolate=on: cannot make a private network "
                         f"namespace: {why}")
    log(f"tasks run on the host network, where their gRPC ports are "
        f"reachable from other hosts ({why} for a private namespace); see "
        "docs/launchers.md, Security.")
    return None
  remove_stale()
  try:
    network = PrivateNetwork(f"{PREFIX}{os.getpid()}")
  except subprocess.CalledProcessError as e:
    if mode == "on":
      raise RuntimeError(f"--isolate=on: ip netns failed: "
                         f"{e.stderr.decode(errors='replace').strip()}")
    log("tasks run on the host network: ip netns failed.")
    return None
  log(f"tasks run in the private network namespace {network.name} (only "
      "its loopback carries the job's gRPC traffic).")
  return network
