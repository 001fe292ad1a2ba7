"""The checkpoint side of tfdist.sharded_params.ShardedParams: its
sharded state saved whole, under an unsharded run's keys, so that a run
resumes on any N, sharded or not, and back.

- A save goes a piece at a time: TF records each sharded entry with no
  value, then each unit's weights, and each of its slot kinds, are
  gathered and written (tfdist.piecewise_save).
- A restore reads only a box of each entry that holds what this
  process's shards hold (tfdist.sliced_restore), unless the chief's state must be sent to
  a worker that restored another (no shared disk): the chief then reads
  its checkpoint again, whole.
"""

import contextlib
import functools

import numpy as np
import tensorflow as tf

from tfdist import flat_layout
from tfdist import piecewise_save
from tfdist import sharded_optimizer
from tfdist import sliced_restore


class ParamsCheckpoint:
  """Mixed into ShardedParams (its units, shards, optimizers, collectives
  and ranks): what its checkpoint holds and how it is written and read."""

  def _init_checkpoint(self, model):
    # Where each of model.trainable_variables lies: (unit, index in it).
    # The checkpoint keys the slots by the model's order, as Keras does.
    where = {id(w): (u, i) for u, unit in enumerate(self.units)
             for i, w in enumerate(unit.weights)}
    self._model_order = [where[id(w)] for w in model.trainable_variables]
    self._variable_at = {ui: v for v, ui in enumerate(self._model_order)}
    self._piecewise = None  # A piecewise_save.PiecewiseSave while saving.
    self._sliced = True  # Whether a restore reads this process's boxes.
    # One function per unit (traced once per kind), not one retraced.
    self._state_fns = [tf.function(functools.partial(self._gather_state, u))
                       for u in range(len(self.units))]
    self.restored = {}  # {key: value} from a restore.

  def _unit_keys(self, u):
    """The checkpoint keys of unit `u`'s state: [kind][weight], its
    weights' first, then each slot kind's."""
    count = range(len(self.units[u].weights))
    return [[("w", u, i) for i in count]] + [
        [(self._variable_at[(u, i)], k) for i in count]
        for k in range(self._slot_count())]

  def _state_pieces(self):
    """{key: whole value} of each unit's weights, then of each of its
    slot kinds: one kind of one unit whole at a time."""
    for u in range(len(self.units)):
      for kind, keys in enumerate(self._unit_keys(u)):
        yield dict(zip(keys, self._state_fns[u](kind), strict=True))

  def _gather_state(self, u, kind):
    """Unit `u`'s weights (kind 0) or slot kind `kind` - 1, whole."""
    def replica_fn():
      local = self._local()
      flat = (self.shards[local][u].read_value() if kind == 0 else
              tf.convert_to_tensor(sharded_optimizer.slots(
                  self.optimizers[local])[u * self._slot_count() + kind - 1]))
      return self._gather(u, flat)
    return self._strategy.experimental_local_results(
        self._strategy.run(replica_fn))[0]

  def _slot_count(self):
    return len(sharded_optimizer.slots(self.optimizers[0])) // len(
        self.units)

  def checkpoint_view(self, optimizer, variables):
    """What goes into the checkpoint as `optimizer` (the model's weights
    save themselves, whole, through their ReleasedWeight)."""
    return sharded_optimizer.checkpoint_view(self, optimizer, variables,
                                             self._slot_count())

  def whole(self, key):
    """While saving, a value-less entry whose value `saving()` writes
    later. At a restore, the boxes of it this process's shards hold
    (tfdist.sliced_restore), or, while `_sliced` is off, all of it."""
    if self._piecewise is not None:
      return self._piecewise.entry(key, tf.float32)
    u, i = self._unit_weight(key)
    shape = self.units[u].weights[i].shape
    box = (self._held_box(u, i) if self._sliced else
           ((0,) * len(shape), tuple(shape)))  # All of it.
    return sliced_restore.request(shape, tf.float32, box)

  def _unit_weight(self, key):
    """(unit, weight index) of a checkpoint key of `_unit_keys`."""
    return key[1:] if key[0] == "w" else self._model_order[key[0]]

  def _rank_boxes(self, u, rank):
    """[(weight index, (begins, sizes))] of unit `u` that shard `rank`
    holds, in the shard's order."""
    layout = self.units[u].layout
    return [(i, (b, s)) for start, end in self._collectives[u].owned(rank)
            for i, b, s in layout.boxes(start, end)]

  def _held_box(self, u, i):
    """The smallest box of weight `i` of unit `u` that holds what this
    process's shards hold of it (None: nothing)."""
    layout = self.units[u].layout
    offset = sum(layout.sizes[:i])
    ends = [(max(start - offset, 0), min(end - offset, layout.sizes[i]))
            for rank in self._ranks
            for start, end in self._collectives[u].owned(rank)]
    ends = [(low, high) for low, high in ends if low < high]
    if not ends:
      return None
    return flat_layout.bounding_box(layout.shapes[i], min(l for l, _ in ends),
                                    max(h for _, h in ends))

  def whole_slot(self, variable, slot):
    return self.whole((variable, slot))

  @contextlib.contextmanager
  def saving(self):
    """Around a checkpoint save (every worker saves together). Gives what
    writes the sharded entries once TF has written the rest: a unit's
    weights, then each of its slot kinds, gathered and written at a time,
    so the save holds one kind of one unit whole, not the whole state
    (tfdist.piecewise_save)."""
    self._piecewise = piecewise_save.PiecewiseSave(
        device=self.shards[0][0].device)
    save = self._piecewise

    def write(path):
      save.write(path, self._state_pieces())

    try:
      yield write
    finally:
      self._piecewise = None

  def _entries(self):
    """Every (key, shape) of the checkpoint's sharded state."""
    return [(key, unit.weights[i].shape)
            for u, unit in enumerate(self.units)
            for kind in self._unit_keys(u) for i, key in enumerate(kind)]

  def share_restored(self, differs_here, read_again):
    """After ChiefBroadcast: see sharded_optimizer.share_restored. What
    this process restored is its shards' boxes only; when the chief's
    state must be sent, the chief reads its checkpoint again, whole
    (`read_again()` restores it: it then holds the whole state)."""
    def whole_on_chief():
      if not self._holds_replica_zero():
        return {}
      self._sliced, self.restored = False, {}
      try:
        read_again()
      finally:
        self._sliced = True
      return self.restored
    def held(key, value):  # Each worker keeps its box of what it gets.
      u, i = self._unit_weight(key)
      box = self._held_box(u, i)
      if box is None:  # None of it is held here.
        return value.reshape(-1)[:0]
      return sliced_restore.box_of(value, (0,) * value.ndim,
                                   box).reshape(box[1])
    self.restored = sharded_optimizer.share_restored(
        self._strategy, self.restored, self._entries(), differs_here,
        read_whole=whole_on_chief, keep=held)

  def _holds_replica_zero(self):
    ids = self._strategy.experimental_local_results(self._strategy.run(
        lambda: tf.distribute.get_replica_context().replica_id_in_sync_group))
    return 0 in [int(i) for i in ids]

  def scatter_restored(self):
    """After a restore: each local shard takes its slice of the restored
    weights and slots, and every shard optimizer the run's step count."""
    if self.restored:
      count = self._slot_count()
      for u, unit in enumerate(self.units):
        for kind, keys in enumerate(self._unit_keys(u)):
          if not all(k in self.restored for k in keys):
            continue  # Not in the checkpoint: the fresh values stay.
          values = [self.restored.pop(k) for k in keys]
          for local, rank in enumerate(self._ranks):
            target = (self.shards[local][u] if kind == 0 else
                      sharded_optimizer.slots(self.optimizers[local])[
                          u * count + kind - 1])
            target.assign(self._restored_shard(u, values, rank))
      self.restored = {}
    if self._optimizer is not None:
      for optimizer in self.optimizers:
        optimizer.iterations.assign(self._optimizer.iterations.value)

  def _restored_shard(self, u, values, rank):
    """Shard `rank` of unit `u` from the restored `values` of its
    weights (or of one slot kind; each whole, or the box `_held_box`
    asked for): its boxes of them, zeros past them."""
    shapes = self.units[u].layout.shapes

    def origin(i):
      whole = tuple(values[i].shape) == shapes[i]
      return (0,) * len(shapes[i]) if whole else self._held_box(u, i)[0]
    pieces = [sliced_restore.box_of(values[i], origin(i), box)
              for i, box in self._rank_boxes(u, rank)]
    flat = np.concatenate(pieces) if pieces else np.zeros([0], np.float32)
    return np.pad(flat, [0, self._collectives[u].shard_size - flat.size])
