"""Elastic membership (--workers=MIN:MAX), apart from the restart policy.

`Membership` owns the group's size: the wait for MIN slots at the start,
what discovery offers while the group runs, which worker is dropped for
good, and how often the size may change (a group that never holds
together stops). `launch.core.Launcher` asks it, and restarts the group.
"""

import dataclasses
import subprocess
import time

from tfdist.errors import PEER_LOST_EXIT_CODE

# An elastic job stops after more membership changes than this within
# the window: a group that never holds together. Changes in a row back
# off as restarts do.
MAX_MEMBERSHIP_CHANGES = 12
MEMBERSHIP_WINDOW_SECONDS = 3600.0
# An elastic job waits this long at its start for MIN worker slots, as
# Horovod's --elastic-timeout does, then stops in one line.
WAIT_FOR_MIN_SECONDS = 600.0
# After a size could not be placed, discovery's offers of that size or
# more are not taken for this long: its view may lag (Ray lists a node
# that is gone as alive for a while).
UNPLACEABLE_HOLD_SECONDS = 120.0


class SlotsUnavailable(RuntimeError):
  """A launcher could not place the group at the size it was asked for
  (Ray still lists a node that is gone, say)."""


class Membership:
  """The size of an elastic group, and when it changes.

  `discover()` returns the worker slots available now, or None when it
  cannot tell; `drop_worker(spec)` tells the launcher that a worker is
  dropped for good (by host or node, not by index: a discovery may have
  reordered the slots since). `sleep(seconds)` returns True when a
  signal cut it short."""

  def __init__(self, cluster, *, discover, drop_worker, every_seconds,
               backoff_seconds, log, sleep):
    self.cluster = cluster
    self._discover = discover if cluster.elastic else None
    self._drop_worker = drop_worker
    self._every = every_seconds
    self._next = time.monotonic() + every_seconds
    self._backoff = backoff_seconds
    self._log = log
    self._sleep = sleep
    self._changes = []  # When membership changed, within the window.
    self._unplaceable = None  # (size, until): a size that failed to place.

  @property
  def discovers(self):
    return self._discover is not None

  def wait_for_min_slots(self):
    """At the start: runs discovery until it offers at least MIN slots,
    then sizes the group; False after WAIT_FOR_MIN_SECONDS or a signal."""
    deadline = time.monotonic() + WAIT_FOR_MIN_SECONDS
    said = False
    while True:
      slots = self._discover()
      if slots is not None and slots >= self.cluster.min_workers:
        break
      if not said:
        offer = ("no answer" if slots is None else
                 f"{slots} worker slot(s), fewer than the minimum of "
                 f"{self.cluster.min_workers}")
        self._log(f"discovery gives {offer}; waiting for more.")
        said = True
      if time.monotonic() > deadline:
        self._log(f"discovery offered fewer than "
                  f"{self.cluster.min_workers} worker slots for "
                  f"{WAIT_FOR_MIN_SECONDS:.0f}s (--workers=MIN:MAX). "
                  "Training did not start.")
        return False
      if self._sleep(self._every):
        return False
    self.cluster = dataclasses.replace(
        self.cluster, workers=min(slots, self.cluster.max_workers))
    self._log(f"discovery offers {slots} worker slot(s): "
              f"starting with {self.cluster.workers} workers.")
    return True

  def offered_size(self):
    """While the group runs, at most every `every_seconds`: the size the
    slots on offer give within MIN:MAX when it is not the group's, else
    None. Below MIN the group carries on: if its hosts are really gone,
    its workers fail and the shrink rule decides."""
    now = time.monotonic()
    if self._discover is None or now < self._next:
      return None
    self._next = now + self._every
    slots = self._discover()
    if slots is None or slots < self.cluster.min_workers:
      return None
    wanted = min(slots, self.cluster.max_workers)
    if wanted == self.cluster.workers or self._held(wanted, now):
      return None
    self._log(f"discovery offers {slots} worker slot(s): asking "
              f"the group to save its step (SIGTERM) and restart with "
              f"{wanted} workers.")
    return wanted

  def _held(self, size, now):
    return bool(self._unplaceable and size >= self._unplaceable[0]
                and now < self._unplaceable[1])

  def shrink_unplaceable(self, why):
    """The group could not be placed at its size: one fewer, and that
    size is not grown back to for UNPLACEABLE_HOLD_SECONDS. False when
    MIN does not allow it, or the job must stop (see `change`)."""
    if not self.discovers or not self.can_shrink():
      return False
    self._unplaceable = (self.cluster.workers,
                         time.monotonic() + UNPLACEABLE_HOLD_SECONDS)
    return self.change(self.cluster.workers - 1, f"{why}; trying one fewer")

  def can_shrink(self):
    return self.cluster.workers - 1 >= self.cluster.min_workers

  def drop(self, task):
    """The worker of `task` failed for good: its slot is given up, unless
    it only lost a peer (then it is not the one lost)."""
    if (self._drop_worker and task
        and task.process.poll() != PEER_LOST_EXIT_CODE):
      self._drop_worker(task.spec)

  def change(self, workers, why, *, stopped_in=0.0):
    """Resizes the group; False when the job must stop instead: more
    than MAX_MEMBERSHIP_CHANGES (or 3 per slot of MAX) within
    MEMBERSHIP_WINDOW_SECONDS (a group that never holds together, such as
    a host that fails each time discovery offers it again), or a signal
    during the backoff. `stopped_in`: how long stopping the old group
    took."""
    now = time.monotonic()
    self._changes = [t for t in self._changes
                     if now - t < MEMBERSHIP_WINDOW_SECONDS] + [now]
    # A large job sees more churn: at least 3 changes per slot of MAX.
    limit = max(MAX_MEMBERSHIP_CHANGES, 3 * self.cluster.max_workers)
    if len(self._changes) > limit:
      self._log(f"{len(self._changes)} membership changes within "
                f"{MEMBERSHIP_WINDOW_SECONDS / 60:.0f} minutes (the last: "
                f"{why}): the group does not hold together; stopping. "
                "Training did not finish.")
      return False
    old = self.cluster.workers
    self.cluster = dataclasses.replace(self.cluster, workers=workers)
    self._log(f"membership change: {old} -> {workers} workers ({why}); "
              f"the group restarts with a new TF_CONFIG from the newest "
              f"of the last checkpoint and the state its survivors kept "
              f"(stopping the old group took {stopped_in:.1f}s).")
    if len(self._changes) == 1:
      return True
    # Changes in a row back off as restarts do.
    delay = min(self._backoff * 2 ** (len(self._changes) - 2), 30.0)
    self._log(f"membership change {len(self._changes)} within "
              f"{MEMBERSHIP_WINDOW_SECONDS / 60:.0f} minutes: the new group "
              f"starts in {delay:.1f}s.")
    return not self._sleep(delay)


def discover_hosts(command, log):
  """[(host, slots)] from `command`'s 'host:slots' lines; None (and a
  log line) when it fails or prints something else."""
  try:
    proc = subprocess.run(command, shell=True, capture_output=True,
                          text=True, timeout=30)
  except subprocess.TimeoutExpired:
    log(f"--host_discovery did not answer within 30s: {command}")
    return None
  hosts = []
  for line in proc.stdout.split():
    host, _, count = line.rpartition(":")
    if not host or not count.isdigit():
      log(f"--host_discovery printed {line!r}, not host:slots; ignored.")
      return None
    hosts.append((host, int(count)))
  if proc.returncode:
    log(f"--host_discovery exited {proc.returncode}; ignored.")
    return None
  return hosts
