"""Whether a run's all-reduce overlapped its backward pass, from the trace
that --profile_steps wrote.

python -m tools.overlap_trace MODEL_DIR

Per profiled train step: when the first gradient all-reduce started and
when the last gradient op ended, both from the step's first gradient op,
and how many gradient ops started after the first all-reduce. Without
overlap every all-reduce waits for the last gradient op, so that count is
0 by construction; with it, the first pack leaves while most of the
backward pass is still to run.
"""

import dataclasses
import statistics
import sys
from typing import List

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2


@dataclasses.dataclass(frozen=True)
class StepOverlap:
  packs: int  # Gradient all-reduces in the step.
  first_allreduce_ms: float  # From the step's first gradient op.
  last_gradient_ms: float
  gradient_ops: int
  gradient_ops_after_first_allreduce: int

  @property
  def overlapped(self):
    return self.first_allreduce_ms < self.last_gradient_ms


def _op_events(space):
  """(start_ps, end_ps, "name:Type") of every TF op on the host."""
  events = []
  for plane in space.planes:
    if plane.name != "/host:CPU":
      continue
    names = plane.event_metadata
    for line in plane.lines:
      for event in line.events:
        name = names[event.metadata_id].name
        if ":" in name and "::" not in name:
          start = line.timestamp_ns * 1000 + event.offset_ps
          events.append((start, start + event.duration_ps, name))
  return sorted(events)


def steps(trace_path) -> List[StepOverlap]:
  """The StepOverlap of each train step in one .xplane.pb trace."""
  space = xplane_pb2.XSpace()
  with tf.io.gfile.GFile(trace_path, "rb") as f:
    space.ParseFromString(f.read())
  events = _op_events(space)
  # Gradient all-reduces run inside the loop's while body; the one after
  # the loop reduces the loop's sums.
  reduces = [e for e in events if e[2].endswith(":CollectiveReduceV2")
             and "while/body" in e[2]]
  gradients = [e for e in events if "gradient_tape" in e[2]]
  packs = len({name for _, _, name in reduces})
  found, previous_end = [], 0
  for k in range(0, len(reduces) - packs + 1, packs):
    step = reduces[k:k + packs]
    first = min(start for start, _, _ in step)
    last = max(start for start, _, _ in step)
    # A step's gradient ops start after the last step's all-reduces ended
    # (its update comes after them) and before its own last all-reduce.
    ops = [e for e in gradients if previous_end < e[0] <= last]
    previous_end = max(end for _, end, _ in step)
    if not ops:
      continue
    origin = ops[0][0]
    found.append(StepOverlap(
        packs=packs, first_allreduce_ms=(first - origin) / 1e9,
        last_gradient_ms=(max(end for _, end, _ in ops) - origin) / 1e9,
        gradient_ops=len(ops),
        gradient_ops_after_first_allreduce=sum(1 for e in ops
                                               if e[0] > first)))
  return found


def find_trace(model_dir):
  """The newest .xplane.pb under model_dir/train/plugins/profile."""
  root = f"{model_dir.rstrip('/')}/train/plugins/profile"
  traces = sorted(tf.io.gfile.glob(f"{root}/*/*.xplane.pb"))
  if not traces:
    raise FileNotFoundError(f"no profile under {root}: run with "
                            "--profile_steps=START,END")
  return traces[-1]


def main(argv):
  if len(argv) != 2:
    print(__doc__.strip().splitlines()[2], file=sys.stderr)
    return 2
  try:
    found = steps(find_trace(argv[1]))
  except FileNotFoundError as e:
    print(f"tools.overlap_trace: error: {e}", file=sys.stderr)
    return 1
  print("| step | packs | first all-reduce (ms) | last gradient op (ms) | "
        "gradient ops after it |")
  print("|---:|---:|---:|---:|---:|")
  for k, s in enumerate(found):
    print(f"| {k} | {s.packs} | {s.first_allreduce_ms:.1f} | "
          f"{s.last_gradient_ms:.1f} | "
          f"{s.gradient_ops_after_first_allreduce}/{s.gradient_ops} |")
  if found:
    share = [s.gradient_ops_after_first_allreduce / s.gradient_ops
             for s in found]
    print(f"{sum(s.overlapped for s in found)} of {len(found)} steps "
          f"overlapped; median share of gradient ops after the first "
          f"all-reduce: {statistics.median(share):.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
