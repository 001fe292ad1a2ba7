"""Manual device placement for model parallelism, as data.

A PlacementPlan says which device holds which blocks of a model. It is
built from a spec (block-name patterns -> devices) or split automatically
into balanced stages by parameter count, checked against the devices that
exist, and printed as a table. This is the only module that calls
tf.device: models and the trainer go through `on(device)`.
"""

import contextlib
import dataclasses
import fnmatch
import json
import os
from typing import Dict, List, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from tfdist import devices as devices_lib
from tfdist.errors import ConfigError


def on(device):
  """The one place a device scope is opened (None: leave placement to TF)."""
  return contextlib.nullcontext() if device is None else tf.device(device)


@dataclasses.dataclass(frozen=True)
class Stage:
  device: str
  blocks: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
  stages: Tuple[Stage, ...]

  def device_of(self, block_name):
    for stage in self.stages:
      if block_name in stage.blocks:
        return stage.device
    raise KeyError(block_name)


def check_devices(devices: Sequence[str], available: Sequence[str]):
  names = {tf.DeviceSpec.from_string(d).to_string() for d in available}
  for device in devices:
    if tf.DeviceSpec.from_string(device).to_string() not in names:
      raise ConfigError(
          f"placement names device {device!r}, which does not exist. "
          f"Devices: {', '.join(available)} (split the CPU with "
          "--num_cpu_devices).")


def _balanced_cuts(sizes: Sequence[int], num_stages: int) -> List[int]:
  """Contiguous split of `sizes` into `num_stages` parts minimizing the
  largest part (exact, by dynamic programming). Returns cut indices."""
  n = len(sizes)
  prefix = np.concatenate([[0], np.cumsum(sizes)])
  best = np.full((num_stages + 1, n + 1), np.inf)
  cut = np.zeros((num_stages + 1, n + 1), dtype=int)
  best[0, 0] = 0
  for k in range(1, num_stages + 1):
    for end in range(k, n + 1):
      for start in range(k - 1, end):
        cost = max(best[k - 1, start], prefix[end] - prefix[start])
        if cost < best[k, end]:
          best[k, end], cut[k, end] = cost, start
  cuts, end = [], n
  for k in range(num_stages, 0, -1):
    cuts.append(end)
    end = cut[k, end]
  return sorted(cuts)


def auto_plan(blocks: Sequence[Tuple[str, int]], devices: Sequence[str],
              num_stages: int) -> PlacementPlan:
  """Balanced stages by parameter count: blocks are (name, params)."""
  if num_stages < 1:
    raise ConfigError(f"num_stages must be >= 1. Received: "
                      f"num_stages={num_stages}")
  if num_stages > len(blocks):
    raise ConfigError(f"num_stages={num_stages} is more than the model's "
                      f"{len(blocks)} blocks ({', '.join(n for n, _ in blocks)})")
  if num_stages > len(devices):
    raise ConfigError(f"num_stages={num_stages} needs {num_stages} devices; "
                      f"only {len(devices)} exist ({', '.join(devices)}). "
                      "Raise --num_cpu_devices.")
  # Parameter-free blocks weigh 1 so that every stage gets some work.
  cuts = _balanced_cuts([max(p, 1) for _, p in blocks], num_stages)
  stages, start = [], 0
  for index, end in enumerate(cuts):
    stages.append(Stage(devices[index],
                        tuple(name for name, _ in blocks[start:end])))
    start = end
  return PlacementPlan(tuple(stages))


def parse_spec(spec: str) -> Dict[str, str]:
  """'pattern=device;...' or a JSON file {pattern: device}."""
  if os.path.isfile(spec):
    with open(spec) as f:
      try:
        return dict(json.load(f))
      except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ConfigError(f"placement file {spec} is not a JSON object of "
                          f"pattern: device ({e})") from None
  rules = {}
  for item in filter(None, (p.strip() for p in spec.split(";"))):
    pattern, sep, device = item.partition("=")
    if not sep or not pattern or not device:
      raise ConfigError(f"--placement entries are pattern=device. "
                        f"Received: {item!r}")
    rules[pattern.strip()] = device.strip()
  return rules


def plan_from_spec(rules: Dict[str, str], block_names: Sequence[str]
                   ) -> PlacementPlan:
  """Each block goes to the first pattern it matches; runs of blocks on one
  device form a stage."""
  stages: List[Stage] = []
  for name in block_names:
    device = next((d for p, d in rules.items() if fnmatch.fnmatch(name, p)),
                  None)
    if device is None:
      raise ConfigError(f"no --placement pattern matches block {name!r}. "
                        f"Blocks: {', '.join(block_names)}")
    if stages and stages[-1].device == device:
      stages[-1] = Stage(device, stages[-1].blocks + (name,))
    else:
      stages.append(Stage(device, (name,)))
  return PlacementPlan(tuple(stages))


def params(layer):
  return sum(int(np.prod(w.shape)) for w in layer.weights)


def _bytes(layer):
  return sum(devices_lib.variable_bytes(w) for w in layer.weights)


def table(plan: PlacementPlan, blocks: Dict[str, keras.layers.Layer]):
  """Lines of the placement table: stage, device, blocks, params, bytes."""
  lines = [f"{'stage':>5}  {'device':<34} {'params':>10} {'bytes':>11}  "
           "blocks"]
  for index, stage in enumerate(plan.stages):
    count = sum(params(blocks[b]) for b in stage.blocks)
    size = sum(_bytes(blocks[b]) for b in stage.blocks)
    lines.append(f"{index:>5}  {stage.device:<34} {count:>10} {size:>11}  "
                 f"{', '.join(stage.blocks)}")
  return lines


def build_blocks(blocks, example, plan=None):
  """Creates every block's variables on its stage's device (or wherever
  TF puts them when there is no plan), in block order, by running
  `example` (a batch of features) through them."""
  x = example
  for block in blocks:
    if plan is None:
      x = block(x)
    else:
      with on(plan.device_of(block.name)):
        x = block(x)


class PipelinedModel(keras.Model):
  """Runs a chain of blocks stage by stage, GPipe style.

  In training the batch is split into micro-batches, each flowing through
  the stages in order. TF's executor runs stage s of micro-batch m while
  stage s+1 runs micro-batch m-1, because the two do not depend on each
  other. The loss over all micro-batches is one tape, so gradients are
  accumulated before the single optimizer step.
  """

  def __init__(self, blocks, plan, num_microbatches, **kwargs):
    super().__init__(**kwargs)
    self.blocks = list(blocks)
    self.plan = plan
    self.num_microbatches = num_microbatches
    self._stages = [[b for b in self.blocks if b.name in stage.blocks]
                    for stage in plan.stages]

  def _forward(self, x, training):
    for stage, blocks in zip(self.plan.stages, self._stages):
      with on(stage.device):
        for block in blocks:
          x = block(x, training=training)
    return x

  def call(self, inputs, training=False):
    if not training or self.num_microbatches == 1:
      return self._forward(inputs, training)
    micro = tf.split(inputs, self.num_microbatches, axis=0)
    return tf.concat([self._forward(m, training) for m in micro], axis=0)
