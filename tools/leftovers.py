"""What a test run left behind on this machine: network namespaces,
processes and temporary directories that were not there before it.

python -m tools.leftovers snapshot FILE   # before the tests
python -m tools.leftovers check FILE      # after them

`check` prints one line for each thing left and exits 1 when a network
namespace or a process of tfdist's (a launcher, a task, a Ray or Slurm
daemon, an sshd a test started) is left; temporary directories are
listed as warnings (docs/testing.md says which are known). Things that
were there before (another session's, the machine's own) are not
counted: what the snapshot saw is left out.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

# Processes of ours: tfdist's modules, the tests' helpers and the engines
# the tests start (Ray, Slurm, munge, sshd).
_OURS = re.compile(r"tfdist|\blaunch\.|tests[./]|raylet|gcs_server|ray::|"
                   r"\bslurm|munged|\bsshd\b")
# Temporary directories of ours: tfdist's own prefixes, and tfds's.
_OUR_TEMP = re.compile(r"^tfdist-|^tmp\w*tfds$")
SETTLE_SECONDS = 20


def _namespaces():
  try:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True,
                         text=True, check=False).stdout
  except OSError:
    return []
  return [line.split()[0] for line in out.splitlines() if line.strip()]


def _processes():
  """{pid: command line} of every live process with a command line
  (kernel threads have none; zombies are left out)."""
  found = {}
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/cmdline", "rb") as f:
        command = f.read().replace(b"\0", b" ").decode(errors="replace")
      with open(f"/proc/{name}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
      continue
    if command.strip() and state != "Z":
      found[name] = command.strip()
  return found


def _ancestors():
  pids, pid = set(), os.getpid()
  while pid > 1:
    pids.add(str(pid))
    try:
      with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
      break
  return pids


def snapshot():
  return {"namespaces": _namespaces(), "processes": _processes(),
          "temp": sorted(os.listdir(tempfile.gettempdir()))}


def left_behind(before, now):
  """(errors, warnings): lines naming what is new since `before`."""
  errors = [f"network namespace {name}" for name in now["namespaces"]
            if name.startswith("tfdist") and name not in before["namespaces"]]
  mine = _ancestors()
  errors += [f"process {pid}: {command[:160]}"
             for pid, command in sorted(now["processes"].items())
             if before["processes"].get(pid) != command
             and pid not in mine and _OURS.search(command)]
  temp = tempfile.gettempdir()
  warnings = [f"temporary directory {temp}/{name}" for name in now["temp"]
              if _OUR_TEMP.search(name) and name not in before["temp"]]
  return errors, warnings


def main(argv):
  if len(argv) != 3 or argv[1] not in ("snapshot", "check"):
    print("usage: python -m tools.leftovers snapshot|check FILE",
          file=sys.stderr)
    return 2
  if argv[1] == "snapshot":
    with open(argv[2], "w") as f:
      json.dump(snapshot(), f)
    return 0
  with open(argv[2]) as f:
    before = json.load(f)
  # A daemon a test stopped may take a few seconds to be gone.
  deadline = time.monotonic() + SETTLE_SECONDS
  errors, warnings = left_behind(before, snapshot())
  while errors and time.monotonic() < deadline:
    time.sleep(1)
    errors, warnings = left_behind(before, snapshot())
  for line in warnings:
    print(f"leftovers: warning: {line}")
  for line in errors:
    print(f"leftovers: error: the tests left {line}")
  if not errors:
    print(f"leftovers: no namespace or process left "
          f"({len(warnings)} temporary director(ies) listed)")
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
