"""The tf.data service's own processes, and a launcher's supervision of
them.

python -m launch.data_service dispatcher --port=P --work_dir=DIR
python -m launch.data_service worker --dispatcher=HOST:P [--port=0]
    [--worker_address=HOST:%port%]

A dispatcher keeps its state in `--work_dir` (fault-tolerant mode), so
one restarted on the same port takes up the jobs it was serving. A data
worker needs TensorFlow only: the pipeline reaches it as a graph, so
neither the model nor the user's module is imported there.

`DataService` is what launch.local runs beside a job: a dispatcher and K
data workers, each restarted when it exits (one log line each), kept
across the job's restarts, and stopped with the launcher.
"""

import argparse
import os
import queue
import signal
import socket
import sys
import threading
import time

# The dispatcher drops a data worker silent for this long, so that
# round-robin readers stop waiting on one that was lost.
WORKER_TIMEOUT_MS = 4000
HEARTBEAT_MS = 500
MODULE = __spec__.name if __spec__ else "launch.data_service"
LISTENING = "dispatcher listening on port"
# On another host (launch.ssh), the installed name.
REMOTE_MODULE = "tfdist.launch.data_service"


def _serve(args):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  service = tf.data.experimental.service
  if args.role == "dispatcher":
    server = service.DispatchServer(service.DispatcherConfig(
        port=args.port, work_dir=args.work_dir, fault_tolerant_mode=True,
        worker_timeout_ms=WORKER_TIMEOUT_MS))
    print(f"{LISTENING} {args.port}", flush=True)
  else:
    address = args.worker_address
    if address == "auto":
      address = f"{_toward(args.dispatcher)}:%port%"
    server = service.WorkerServer(service.WorkerConfig(
        dispatcher_address=args.dispatcher, port=args.port,
        worker_address=address or None, heartbeat_interval_ms=HEARTBEAT_MS))
    print(f"data worker serving {args.dispatcher}", flush=True)
  server.join()


def _toward(dispatcher):
  """This host's IP on the route to the dispatcher: the address its
  trainers, which reach the dispatcher, can reach this host at."""
  host, _, port = dispatcher.rpartition(":")
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    probe.connect((host, int(port)))  # UDP: no packet is sent.
    return probe.getsockname()[0]


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m launch.data_service")
  parser.add_argument("role", choices=("dispatcher", "worker"))
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--work_dir", default="")
  parser.add_argument("--dispatcher", default="")
  parser.add_argument("--worker_address", default="",
                      help="HOST:PORT the trainers reach this data worker "
                      "at (%%port%% stands for its port); auto: this "
                      "host's IP on the route to the dispatcher; default "
                      "localhost:%%port%%.")
  args = parser.parse_args(argv)
  if args.role == "dispatcher" and not (args.port and args.work_dir):
    parser.error("a dispatcher needs --port and --work_dir")
  if args.role == "worker" and not args.dispatcher:
    parser.error("a data worker needs --dispatcher=HOST:PORT")
  signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
  _serve(args)


# TensorFlow's start-up lines, written before its logging is set up.
_NOISE = ("All log messages before absl::InitializeLog()",
          "oneDNN custom operations are on",
          "This TensorFlow binary is optimized", "cpu_feature_guard")


def commands(*, python, port, work_dir, data_workers, host="127.0.0.1",
             module=MODULE, worker_address=""):
  """{name: argv} of a dispatcher on `port` and its data workers."""
  base = [*python, "-m", module]
  found = {"dispatcher": [*base, "dispatcher", f"--port={port}",
                          f"--work_dir={work_dir}"]}
  advertised = [f"--worker_address={worker_address}"] if worker_address \
      else []
  for index in range(data_workers):
    found[f"data_worker:{index}"] = [*base, "worker",
                                     f"--dispatcher={host}:{port}",
                                     *advertised]
  return found


class DataService:
  """A dispatcher and its data workers beside a job, each restarted when
  it exits. `start_process(name, argv, env)` starts one (its output
  piped);
  `log(text)` writes a launcher line; `write(name, line)` a process's."""

  def __init__(self, *, commands_by_name, start_process, log, write,
               env=None, restart_seconds=0.5):
    self._commands = dict(commands_by_name)
    self._start = start_process
    self._log = log
    self._write = write
    self._env = {**os.environ, "PYTHONUNBUFFERED": "1",
                 "TF_CPP_MIN_LOG_LEVEL": "1", **(env or {})}
    self._restart_seconds = restart_seconds
    self._processes = {}
    self._closed = threading.Event()
    self._listening = threading.Event()
    self._restarts = queue.Queue()
    self._lock = threading.Lock()

  def start(self, *, timeout=300.0):
    """Starts every process, then waits until the dispatcher says it
    listens (from inside any network namespace): a trainer started sooner
    would give up on it."""
    for name in self._commands:
      self._launch(name)
    threading.Thread(target=self._restart_forever, daemon=True).start()
    if not self._listening.wait(timeout):
      dispatcher = self.processes()["dispatcher"]
      raise RuntimeError(f"the tf.data dispatcher (pid {dispatcher.pid}) "
                         f"did not listen within {timeout:g} s")
    self._log(f"tf.data service: a dispatcher and "
              f"{len(self._commands) - 1} data workers, pids "
              + " ".join(f"{n}={p.pid}" for n, p in self.processes().items()))

  def processes(self):
    with self._lock:
      return dict(self._processes)

  def _launch(self, name):
    process = self._start(name, self._commands[name], self._env)
    with self._lock:
      self._processes[name] = process
    threading.Thread(target=self._watch, args=(name, process),
                     daemon=True).start()

  def _watch(self, name, process):
    for raw in process.stdout:
      line = raw.decode("utf-8", "replace").rstrip("\n")
      if not any(noise in line for noise in _NOISE):
        self._write(name, line)
      if line.startswith(LISTENING):
        self._listening.set()
    code = process.wait()
    if self._closed.is_set():
      return
    what = (f"signal {-code}" if code < 0 else f"exit code {code}")
    again = ("restarted from its work_dir" if name == "dispatcher"
             else "a replacement joins")
    self._log(f"tf.data service: {name} (pid {process.pid}) ended with "
              f"{what}; {again}.")
    self._restarts.put(name)

  def _restart_forever(self):
    # One thread starts every replacement and outlives them: a child gets
    # SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG).
    while True:
      name = self._restarts.get()
      if name is None or self._closed.is_set():
        return
      time.sleep(self._restart_seconds)
      if not self._closed.is_set():
        self._launch(name)

  def close(self):
    self._closed.set()
    self._restarts.put(None)
    for process in self.processes().values():
      if process.poll() is None:
        process.kill()
    for process in self.processes().values():
      process.wait()


if __name__ == "__main__":
  main(sys.argv[1:])
