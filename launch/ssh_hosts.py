"""The worker slots of an SSH job: the hosts --hosts names, or those a
discovery script offers (--host_discovery), with the slot of a worker
that failed for good kept out for a while."""

import time

from . import membership


# A slot whose worker failed for good is not taken again from discovery
# for this long, doubled at each failure on the same host (up to an
# hour), as Horovod keeps a failing host out: a script that still lists
# a broken host would otherwise grow the group back onto it until the
# membership-change limit ends the job.
DROPPED_SLOT_SECONDS = 120.0
MAX_DROPPED_SLOT_SECONDS = 3600.0


class WorkerHosts:
  """The worker slots, in order: the worker hosts --hosts names, or,
  with a discovery `command`, the hosts it offers (a host with k slots
  runs up to k workers). Workers take the first slots. The discovery
  script is the truth, but for a slot dropped after a failure: it stays
  out for DROPPED_SLOT_SECONDS (doubling) even when offered again."""

  def __init__(self, hosts, *, command="", min_workers=1, log=print,
               clock=time.monotonic):
    self._hosts = list(hosts)
    self._command = command
    self._min_workers = min_workers
    self._log = log
    self._clock = clock
    self._kept_out = {}  # host -> [until, ...]: one per dropped slot.
    self._failures = {}  # host -> workers dropped there so far.
    self._said = {}  # host -> the kept-out slots last logged.

  def discover(self):
    """Runs the discovery command; returns the number of slots it
    offers, less those kept out, or None when it cannot tell. An offer
    below MIN is not taken: the running group keeps its hosts."""
    offered = membership.discover_hosts(self._command, self._log)
    if offered is None:
      return None
    hosts = []
    for host, slots in offered:
      out = self._out(host, slots)
      hosts.extend([host] * (slots - out))
    if len(hosts) >= self._min_workers:
      self._hosts = hosts
    return len(hosts)

  def _out(self, host, slots):
    """How many of `host`'s `slots` on offer stay out now."""
    now = self._clock()
    until = [t for t in self._kept_out.get(host, []) if t > now]
    self._kept_out[host] = until
    out = min(len(until), slots)
    if out and self._said.get(host) != until:  # Once per drop, not per look.
      self._said[host] = until
      self._log(f"discovery offers {host} again, where a worker failed: "
                f"{out} of its slot(s) kept out for {max(until) - now:.0f}s "
                "more.")
    return out

  def drop(self, spec):
    """The worker of TaskSpec `spec` is dropped: a slot of its host goes
    (unless a discovery since then has already left the host out), and
    stays out of discovery's offers for a while."""
    host = spec.address.rpartition(":")[0]
    if host in self._hosts:
      self._hosts.remove(host)
    failures = self._failures.get(host, 0)
    self._failures[host] = failures + 1
    seconds = min(DROPPED_SLOT_SECONDS * 2**failures,
                  MAX_DROPPED_SLOT_SECONDS)
    self._kept_out.setdefault(host, []).append(self._clock() + seconds)

  def take(self, count):
    if count > len(self._hosts):
      raise ValueError(f"{count} workers need {count} worker slots; "
                       f"{len(self._hosts)} are known: {self._hosts}")
    return self._hosts[:count]
