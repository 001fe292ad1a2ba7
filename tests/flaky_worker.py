"""A stand-in task for launcher tests (no TensorFlow): worker 1 dies at
once (SIGKILL, as a host that fails), on every attempt; any other task
runs until SIGTERM, then exits 42 as a preempted tfdist task does."""

import json
import os
import signal
import sys
import time

if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
  os.kill(os.getpid(), signal.SIGKILL)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
while True:
  time.sleep(0.1)
