"""The tf.data service's own processes, and a launcher's supervision of
them.

python -m launch.data_service dispatcher --port=P --work_dir=DIR
python -m launch.data_service worker --dispatcher=HOST:P [--port=0]
    [--worker_address=HOST:%port%]

A dispatcher keeps its state in `--work_dir` (fault-tolerant mode), so
one restarted on the same port takes up the jobs it was serving. A data
worker needs TensorFlow only: the pipeline reaches it as a graph, so
neither the model nor the user's module is imported there.

`DataService` is what launch.local, launch.ssh and launch.ray run beside
a job: a dispatcher and K data workers, each restarted when it exits (one
log line each, with a backoff), kept across the job's restarts, and
stopped with the launcher.
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
# A job no trainer has read for this long is collected: each resume
# registers a new one, and the old one's pipeline holds memory on every
# data worker. A live trainer's iterator keeps its job alive.
JOB_GC_MS = 5 * 60_000
HEARTBEAT_MS = 500
MODULE = __spec__.name if __spec__ else "launch.data_service"
LISTENING = "dispatcher listening on port"
SERVING = "data worker serving"
# A process that ends this soon after its start failed to start: each such
# failure doubles the wait before the next start, and after this many in a
# row it is not started again.
QUICK_SECONDS, MAX_QUICK_FAILURES, MAX_BACKOFF_SECONDS = 20.0, 5, 30.0
# On another host (launch.ssh), the installed name.
REMOTE_MODULE = "tfdist.launch.data_service"


def dispatcher_config(*, port, work_dir, job_gc_timeout_ms=JOB_GC_MS):
  """The dispatcher's settings, as TF's DispatcherConfig proto: the
  Python DispatcherConfig cannot ask for dynamic-sharding jobs to be
  collected, and every resume registers one (their pipelines, shuffle
  buffers and prefetched batches stay on the data workers otherwise)."""
  from tensorflow.core.protobuf import service_config_pb2  # pylint: disable=g-import-not-at-top
  return service_config_pb2.DispatcherConfig(
      port=port, protocol="grpc", work_dir=work_dir,
      fault_tolerant_mode=bool(work_dir),
      worker_timeout_ms=WORKER_TIMEOUT_MS, gc_dynamic_sharding_jobs=True,
      job_gc_check_interval_ms=min(job_gc_timeout_ms, 60_000),
      job_gc_timeout_ms=job_gc_timeout_ms)


def _serve(args):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  service = tf.data.experimental.service
  if args.role == "dispatcher":
    server = service.DispatchServer(dispatcher_config(
        port=args.port, work_dir=args.work_dir))
    print(f"{LISTENING} {args.port}", flush=True)
  else:
    address = args.worker_address
    if address == "auto":
      address = f"{_toward(args.dispatcher)}:%port%"
    server = service.WorkerServer(service.WorkerConfig(
        dispatcher_address=args.dispatcher, port=args.port,
        worker_address=address or None, heartbeat_interval_ms=HEARTBEAT_MS))
    print(f"{SERVING} {args.dispatcher}", flush=True)
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
  # SIGTERM keeps its default action: a Python handler would never run
  # while the main thread waits inside the server's join().
  _serve(args)


# TensorFlow's start-up lines, written before its logging is set up.
_NOISE = ("All log messages before absl::InitializeLog()",
          "oneDNN custom operations are on",
          "This TensorFlow binary is optimized", "cpu_feature_guard")


def commands(*, python, port, work_dir, data_workers, host="127.0.0.1",
             module=MODULE, worker_address="", worker_port=0):
  """{name: argv} of a dispatcher on `port` of `host` and its data
  workers (on `worker_port`, 0: any; advertising `worker_address`)."""
  base = [*python, "-m", module]
  found = {"dispatcher": [*base, "dispatcher", f"--port={port}",
                          f"--work_dir={work_dir}"]}
  worker = [*base, "worker", f"--dispatcher={host}:{port}"]
  if worker_port:
    worker.append(f"--port={worker_port}")
  if worker_address:
    worker.append(f"--worker_address={worker_address}")
  for index in range(data_workers):
    found[f"data_worker:{index}"] = list(worker)
  return found


class DataService:
  """A dispatcher and its data workers beside a job, each restarted when
  it exits (with a backoff; one that keeps failing at its start is given
  up, logged). `start_process(name, argv, env)` starts one, its output
  piped; `log(text)` writes a launcher line; `write(name, line)` one of a
  process's lines; `on_give_up()` is called once the job is running when
  the dispatcher or the last data worker is given up, since its trainers
  would wait for them for ever (a launcher stops its job)."""

  def __init__(self, *, commands_by_name, start_process, log, write,
               env=None, restart_seconds=0.5, on_give_up=None):
    self._commands = dict(commands_by_name)
    self._start = start_process
    self._log = log
    self._write = write
    self._env = {**os.environ, "PYTHONUNBUFFERED": "1",
                 "TF_CPP_MIN_LOG_LEVEL": "1", **(env or {})}
    self._restart_seconds = restart_seconds
    self._on_give_up = on_give_up
    self._processes = {}
    self._quick_failures = {name: 0 for name in self._commands}
    self._closed = threading.Event()
    self._running = threading.Event()  # start() returned.
    self._ready = threading.Condition()
    self._serving = set()  # Names that said they listen or serve.
    self._given_up = set()
    self._stopping = False  # on_give_up was called.
    self._dispatcher_down = None  # Its exit code, if it ended unready.
    self._restarts = queue.Queue()
    self._lock = threading.Lock()

  def start(self, *, timeout=300.0):
    """Starts every process, then waits until the dispatcher listens and
    every data worker serves (each says so, from inside any network
    namespace): a trainer started sooner would give up on the dispatcher,
    and a data worker joining late would take an epoch's unit late."""
    for name in self._commands:
      self._launch(name)
    threading.Thread(target=self._restart_forever, daemon=True).start()
    with self._ready:
      ready = self._ready.wait_for(
          lambda: (len(self._serving) == len(self._commands)
                   or self._dispatcher_down is not None
                   or self._given_up), timeout)
    if self._dispatcher_down is not None:
      raise RuntimeError(f"the tf.data dispatcher ended with "
                         f"{_ending(self._dispatcher_down)} before it "
                         f"listened")
    if self._given_up:
      raise RuntimeError(
          f"the tf.data service's {', '.join(sorted(self._given_up))} ended "
          f"{MAX_QUICK_FAILURES} times in a row at its start")
    if not ready:
      waiting = sorted(set(self._commands) - self._serving)
      raise RuntimeError(f"the tf.data service's {', '.join(waiting)} did "
                         f"not start within {timeout:g} s")
    self._running.set()
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
      closed = self._closed.is_set()
    if closed:  # Started while close() ran: it saw the process before.
      process.kill()
      process.wait()
      return
    threading.Thread(target=self._watch,
                     args=(name, process, time.monotonic()),
                     daemon=True).start()

  def _watch(self, name, process, started):
    for raw in process.stdout:
      line = raw.decode("utf-8", "replace").rstrip("\n")
      if not any(noise in line for noise in _NOISE):
        self._write(name, line)
      if line.startswith((LISTENING, SERVING)):
        with self._ready:
          self._serving.add(name)
          self._ready.notify_all()
    code = process.wait()
    if self._closed.is_set():
      return
    if name == "dispatcher" and name not in self._serving:
      with self._ready:
        self._dispatcher_down = code
        self._ready.notify_all()
    self._ended(name, f"(pid {process.pid}) ended with {_ending(code)}",
                quick=time.monotonic() - started < QUICK_SECONDS)

  def _ended(self, name, how, *, quick):
    """`name` ended, or could not be started: restarts it, or gives it up
    after MAX_QUICK_FAILURES quick ends in a row."""
    if self._closed.is_set():
      return
    self._quick_failures[name] = self._quick_failures[name] + 1 if quick \
        else 0
    if self._quick_failures[name] < MAX_QUICK_FAILURES:
      again = ("restarting it from its work_dir" if name == "dispatcher"
               else "restarting it: the replacement joins the running job")
      self._log(f"tf.data service: {name} {how}; {again}.")
      self._restarts.put(name)
      return
    with self._ready:
      self._given_up.add(name)
      self._ready.notify_all()
      workers = self._given_up - {"dispatcher"}
      lost = (name == "dispatcher"
              or len(workers) == len(self._commands) - 1)
      # Once: the dispatcher and the last data worker may both be lost.
      stop = (lost and self._running.is_set() and self._on_give_up
              and not self._stopping)
      self._stopping = self._stopping or bool(stop)
    self._log(f"tf.data service: {name} {how}, {MAX_QUICK_FAILURES} times in "
              f"a row within {QUICK_SECONDS:g} s of its start: not restarted "
              "again" + ("; stopping the job, whose trainers would wait for "
                         "it." if stop else "."))
    if stop:
      self._on_give_up()

  def _restart_forever(self):
    # One thread starts every replacement and outlives them: a child gets
    # SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG).
    while True:
      name = self._restarts.get()
      if name is None or self._closed.is_set():
        return
      failures = self._quick_failures[name]
      self._closed.wait(min(MAX_BACKOFF_SECONDS,
                            self._restart_seconds * 2 ** max(failures - 1, 0)))
      if self._closed.is_set():
        return
      try:
        self._launch(name)
      except Exception as e:  # pylint: disable=broad-except
        # A lost host or node: counted as an end at its start.
        self._ended(name, f"could not be started again ({e})", quick=True)

  def close(self):
    with self._lock:
      self._closed.set()
    self._restarts.put(None)
    for process in self.processes().values():
      if process.poll() is None:
        process.kill()
    for process in self.processes().values():
      process.wait()


def stop_launcher():
  """A DataService's `on_give_up` in a launcher: SIGTERM to itself, which
  launch.core forwards to the job (its trainers save and end)."""
  os.kill(os.getpid(), signal.SIGTERM)


def _ending(code):
  return f"signal {-code}" if code is not None and code < 0 else \
      f"exit code {code}"


if __name__ == "__main__":
  main(sys.argv[1:])
