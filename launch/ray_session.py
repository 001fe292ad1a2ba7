"""Ray for one launcher run (launch.ray, launch.sweep): a cluster joined,
or a local Ray started and removed at the end."""

import contextlib
import os
import shutil
import socket
import tempfile

from tfdist import quiet

try:
  import ray as ray_module
except ImportError:  # The `ray` extra is not installed; session() says so.
  ray_module = None


class RayUnavailable(RuntimeError):
  """Ray is not installed, or could not be started or reached."""


def _check_reachable(address, timeout=10.0):
  """Ray retries an unreachable GCS for minutes; say so at once instead."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host, int(port)), timeout=timeout):
      return
  except (OSError, ValueError) as e:
    raise RayUnavailable(f"no Ray cluster answers at --address={address} "
                         f"({e}).") from None


@contextlib.contextmanager
def session(*, address, cpus_needed, log):
  """Ray for one launcher run, shared with launch.sweep: joins `address`,
  or starts a local Ray with at least `cpus_needed` logical CPUs (the
  tasks, not Ray, share the cores) and removes its files at the end.
  Ray's start-up lines go to a buffer, shown only if it fails."""
  if ray_module is None:
    raise RayUnavailable("Ray is not installed; install the extra: pip "
                         "install -e '.[cpu,ray]'")
  if address and address != "auto" and "://" not in address:
    _check_reachable(address)
  # Short: Ray's socket paths live under it and must stay under 108 bytes.
  temp_dir = tempfile.mkdtemp(prefix="tfdist-ray-")
  try:
    with quiet.native_stderr_captured():
      if address:
        ray_module.init(address=address, log_to_driver=False,
                        logging_level="ERROR", configure_logging=False)
      else:
        cpus = max(os.cpu_count() or 1, int(cpus_needed + 0.999))
        ray_module.init(num_cpus=cpus, include_dashboard=False,
                        log_to_driver=False, logging_level="ERROR",
                        configure_logging=False, _temp_dir=temp_dir)
  except (ConnectionError, RuntimeError, ValueError) as e:
    shutil.rmtree(temp_dir, ignore_errors=True)
    raise RayUnavailable(f"could not start or reach Ray "
                         f"(--address={address}): {e}") from None
  log(f"joined the Ray cluster at {address}" if address else
      f"a local Ray is up with {cpus} CPUs")
  try:
    yield
  finally:
    ray_module.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
