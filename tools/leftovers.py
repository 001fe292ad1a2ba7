"""What a test run left behind on this machine: network namespaces,
processes and temporary directories that were not there before it.

TFDIST_RUN_MARK=TOKEN python -m tools.leftovers snapshot FILE  # before
TFDIST_RUN_MARK=TOKEN python -m tools.leftovers check FILE     # after

`check` prints one line for each thing left and exits 1 when a network
namespace named tfdist*, a process of the run or a temporary directory
of ours (tfdist-*, tfds's tmp*tfds) is left. A process of the run is
one that inherited TFDIST_RUN_MARK=TOKEN from the tests (a launcher, a
task, a Ray or Slurm daemon, an sshd a test started): other users' and
other sessions' processes are not counted, whatever their names. What
the snapshot saw is left out.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

MARK = "TFDIST_RUN_MARK"
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


def _processes(mark):
  """{pid: command line} of every live process whose environment holds
  MARK=`mark` (zombies are left out)."""
  found, wanted = {}, f"{MARK}={mark}".encode()
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/environ", "rb") as f:
        if wanted not in f.read().split(b"\0"):
          continue
      with open(f"/proc/{name}/cmdline", "rb") as f:
        command = f.read().replace(b"\0", b" ").decode(errors="replace")
      with open(f"/proc/{name}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
      continue
    if state != "Z":
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


def snapshot(mark):
  return {"namespaces": _namespaces(), "processes": _processes(mark),
          "temp": sorted(os.listdir(tempfile.gettempdir()))}


def left_behind(before, now, mine=frozenset()):
  """Lines naming what is new since `before`; `mine`: the pids of this
  check and its callers."""
  errors = [f"network namespace {name}" for name in now["namespaces"]
            if name.startswith("tfdist") and name not in before["namespaces"]]
  errors += [f"process {pid}: {command[:160]}"
             for pid, command in sorted(now["processes"].items())
             if pid not in before["processes"] and pid not in mine]
  temp = tempfile.gettempdir()
  errors += [f"temporary directory {temp}/{name}" for name in now["temp"]
             if _OUR_TEMP.search(name) and name not in before["temp"]]
  return errors


def main(argv):
  if len(argv) != 3 or argv[1] not in ("snapshot", "check"):
    print("usage: python -m tools.leftovers snapshot|check FILE",
          file=sys.stderr)
    return 2
  mark = os.environ.get(MARK)
  if not mark:
    print(f"tools.leftovers needs {MARK} set, for the tests to inherit",
          file=sys.stderr)
    return 2
  if argv[1] == "snapshot":
    with open(argv[2], "w") as f:
      json.dump(snapshot(mark), f)
    return 0
  with open(argv[2]) as f:
    before = json.load(f)
  # A daemon a test stopped may take a few seconds to be gone.
  deadline = time.monotonic() + SETTLE_SECONDS
  while True:
    errors = left_behind(before, snapshot(mark), _ancestors())
    if not errors or time.monotonic() > deadline:
      break
    time.sleep(1)
  for line in errors:
    print(f"leftovers: error: the tests left {line}")
  if not errors:
    print("leftovers: no namespace, process or temporary directory left")
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
