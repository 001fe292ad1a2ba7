"""--data_service's address and modes, checked before TensorFlow loads
(tfdist.data.service is the rest, with TensorFlow)."""

import socket
import time

from tfdist.errors import ConfigError

MODES = ("dynamic", "parallel_epochs")
# A dispatcher found down is waited for this long by default before the
# run gives up (--data_service_wait).
REACH_SECONDS = 10.0


def parse_address(text):
  """(host, port) of --data_service=grpc://HOST:PORT (or HOST:PORT)."""
  rest = text[len("grpc://"):] if text.startswith("grpc://") else text
  host, colon, port = rest.rpartition(":")
  if not colon or not host or not port.isdigit() or not (
      0 < int(port) < 65536) or "/" in rest:
    raise ConfigError(f"--data_service takes grpc://HOST:PORT. Received: "
                      f"--data_service={text}")
  return host.strip("[]"), int(port)


def check_reachable(text, *, wait_seconds=REACH_SECONDS):
  """Refuses, before TensorFlow loads, a dispatcher that does not answer:
  TF's own client would retry for an hour."""
  host, port = parse_address(text)
  deadline = time.monotonic() + wait_seconds
  while True:
    try:
      with socket.create_connection((host, port), timeout=2.0):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        reason = e.strerror or type(e).__name__
        raise ConfigError(
            f"--data_service={text}: no tf.data dispatcher answers there "
            f"({reason}) after {wait_seconds:g} s.") from None
      time.sleep(0.5)
