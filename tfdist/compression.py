"""The gradient all-reduce: float32, cast to float16/bfloat16, or PowerSGD.

A Keras 3 optimizer all-reduces gradients itself under a strategy
(`_all_reduce_sum_gradients`). Casting before that adds a second reduction
(we measured 1.5x the float32 bytes, not 0.5x), and clipping before it
clips each replica's gradients differently. So the train step reduces the
gradients itself (here) and the optimizer's own reduction is switched off.

PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient
Compression") sends each big gradient matrix M (n x m) as two thin ones:
P = M Q (n x r), summed over replicas and orthonormalized, then
Q = M^T P (m x r), summed. Each replica keeps what its own M lost to the
projection (error feedback) and adds it to the next gradient, and Q is
reused as the next step's start (warm start, one power iteration per step).
"""

import math

import tensorflow as tf

from tfdist import flat_layout
from tfdist import options

SUM = tf.distribute.ReduceOp.SUM


def _already_reduced(grads_and_vars):
  return list(grads_and_vars)


def take_over_reduction(optimizer):
  """Makes `optimizer` apply gradients as given (in place): the caller has
  all-reduced them with a reducer from here."""
  target = getattr(optimizer, "inner_optimizer", optimizer)
  if not hasattr(target, "_all_reduce_sum_gradients"):
    raise RuntimeError(
        "This Keras version has no _all_reduce_sum_gradients hook; tfdist "
        "cannot take over its gradient all-reduce.")
  target._all_reduce_sum_gradients = _already_reduced  # pylint: disable=protected-access
  return optimizer


def _sum_in(context, tensors, wire):
  """One collective call of `tensors`, sent in dtype `wire` and returned in
  their own dtypes."""
  if not tensors:
    return []
  sent = [tf.cast(t, wire) if t.dtype != wire else t for t in tensors]
  reduced = context.all_reduce(SUM, sent)
  return [tf.cast(r, t.dtype) if r.dtype != t.dtype else r
          for r, t in zip(reduced, tensors)]


# Packs of gradients: 4 MiB was the fastest of 256 KiB, 1 MiB and 4 MiB
# in the lab (docs/compression-and-scaling.md, "Overlap"); fewer
# collectives cost less here. The first pack is smaller, as PyTorch DDP's first bucket is: the last
# layer's gradients exist first, and the earlier they leave the better.
DEFAULT_PACK_BYTES = 4 << 20
FIRST_PACK_BYTES = 256 << 10


def plan_packs(sizes, *, pack_bytes, first_pack_bytes=None):
  """Groups of indices into `sizes` (bytes per gradient, in the order the
  variables are listed): the reverse order, consecutive gradients up to
  `pack_bytes` each (`first_pack_bytes` for the first). A gradient larger
  than a pack goes alone. pack_bytes=None: one pack of everything."""
  if not sizes:
    return []
  order = list(reversed(range(len(sizes))))
  if pack_bytes is None:
    return [order]
  packs, current, filled = [], [], 0
  limit = first_pack_bytes or pack_bytes
  for index in order:
    if current and filled + sizes[index] > limit:
      packs.append(current)
      current, filled, limit = [], 0, pack_bytes
    current.append(index)
    filled += sizes[index]
  packs.append(current)
  return packs


class PlainReducer:
  """Sums gradients over the replicas in sync, sent in `dtype`.

  `overlap`: the gradients go in packs of `pack_bytes`, last layer first,
  one collective per pack, so each pack's all-reduce can start as soon as
  its gradients exist while the backward pass goes on (PyTorch DDP's
  reverse-ordered buckets; TF's own CollectiveAllReduce reverses its packs
  too). Without it, one collective of every gradient, after all of them.
  """

  start_step = None  # One train step for the whole run.

  def compressed_from(self, step):
    return compressed_from(self, step)

  def __init__(self, *, dtype="float32", overlap=True, pack_bytes=0):
    if pack_bytes < 0:
      raise ValueError(f"pack_bytes must be >= 0 (0: the default, "
                       f"{DEFAULT_PACK_BYTES}). Received: "
                       f"pack_bytes={pack_bytes}")
    self._wire = tf.as_dtype(dtype)
    self.overlap = overlap
    self.pack_bytes = pack_bytes or DEFAULT_PACK_BYTES

  def packs_for(self, grads):
    """The packs (lists of indices into `grads`) of the dense gradients."""
    dense = [i for i, g in enumerate(grads)
             if g is not None and not isinstance(g, tf.IndexedSlices)]
    sizes = [g.shape.num_elements() * self._wire.size
             for g in (grads[i] for i in dense)]
    if not self.overlap:
      groups = plan_packs(sizes, pack_bytes=None)
    else:
      groups = plan_packs(
          sizes, pack_bytes=self.pack_bytes,
          first_pack_bytes=min(FIRST_PACK_BYTES, self.pack_bytes))
    return [[dense[k] for k in group] for group in groups]

  def reduce(self, grads, compressed=False):  # pylint: disable=unused-argument
    """Call in a replica context; None gradients stay None."""
    context = tf.distribute.get_replica_context()
    result = list(grads)
    if context is None or context.num_replicas_in_sync == 1:
      return result
    for pack in self.packs_for(grads):
      for i, total in zip(pack, self._sum_flat(context,
                                               [grads[i] for i in pack])):
        result[i] = total
    # Sparse gradients (embedding lookups) go as they are, after the packs.
    sparse = [i for i, g in enumerate(grads)
              if isinstance(g, tf.IndexedSlices)]
    for i, total in zip(sparse, _sum_in(context, [grads[i] for i in sparse],
                                        self._wire)):
      result[i] = total
    return result

  def _sum_flat(self, context, tensors):
    """One collective: `tensors` flattened into one vector in the wire
    dtype, summed, and split back into their shapes and dtypes."""
    layout = flat_layout.FlatLayout([t.shape for t in tensors])
    total = context.all_reduce(SUM, layout.flatten(tensors, self._wire))
    return layout.unflatten(total, [t.dtype for t in tensors])

  def reset(self):
    pass


def compressed_from(reducer, step):
  """Whether a loop call starting at `step` runs `reducer`'s compressed
  all-reduce, and the step where that changes (None: never)."""
  start = reducer.start_step
  if start is None:
    return False, None
  return step >= start, (start if step < start else None)


def matrix_shape(shape):
  """A gradient as a matrix: conv kernels [..., in, out] -> [prod, out]."""
  if len(shape) < 2:
    return None
  return (math.prod(shape[:-1]), shape[-1])


def compressed_rank(shape, rank, min_ratio):
  """The rank PowerSGD sends `shape` at, or 0 when it goes as it is: a
  vector, or a matrix where r(n+m) is not `min_ratio`x smaller than nm."""
  matrix = matrix_shape(shape)
  if matrix is None:
    return 0
  n, m = matrix
  r = min(rank, n, m)
  return r if r * (n + m) * min_ratio <= n * m else 0


def wire_elements(shapes, rank, min_ratio=2.0):
  """(PowerSGD, plain) elements all-reduced per step for these shapes."""
  sent = plain = 0
  for shape in shapes:
    size = math.prod(shape)
    plain += size
    r = compressed_rank(shape, rank, min_ratio)
    sent += r * sum(matrix_shape(shape)) if r else size
  return sent, plain


class PowerSGDReducer:
  """Rank-`rank` PowerSGD with error feedback and warm start.

  Build it under the strategy's scope: it keeps per-replica error buffers
  and Q matrices (sync-on-read variables, one copy per replica, not in the
  checkpoint). `start_step`: steps before it are plain all-reduces.
  `min_ratio`: matrices that would not shrink by this much go as they are
  (tests lower it to compress everything).
  """

  def __init__(self, *, variables, rank, start_step=0, dtype="float32",
               min_ratio=2.0, seed=0, overlap=True, pack_bytes=0):
    if not isinstance(rank, int) or rank < 1:
      raise ValueError(f"rank must be a positive integer. Received: "
                       f"rank={rank!r}")
    if start_step < 0:
      raise ValueError(f"start_step must be >= 0. Received: "
                       f"start_step={start_step}")
    self.rank = rank
    self.start_step = start_step
    # Before start_step: the plain all-reduce, overlapped.
    self._plain = PlainReducer(dtype=dtype, overlap=overlap,
                               pack_bytes=pack_bytes)
    self._wire = tf.as_dtype(dtype)
    self._shapes = [tuple(v.shape) for v in variables]
    self._min_ratio = min_ratio
    self._errors, self._qs = {}, {}
    local = dict(synchronization=tf.VariableSynchronization.ON_READ,
                 aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                 trainable=False)
    for i, shape in enumerate(self._shapes):
      r = compressed_rank(shape, rank, min_ratio)
      if not r:
        continue
      n, m = matrix_shape(shape)
      self._errors[i] = tf.Variable(tf.zeros([n, m]), name=f"powersgd_e{i}",
                                    **local)
      self._qs[i] = tf.Variable(self._initial_q(m, r, seed, i),
                                name=f"powersgd_q{i}", **local)
    self._seed = seed

  @staticmethod
  def _initial_q(m, r, seed, index):
    # The same on every replica and worker: P = M Q must use one Q.
    return tf.random.stateless_normal([m, r], seed=(seed, index))

  def describe(self):
    sent, plain = wire_elements(self._shapes, self.rank, self._min_ratio)
    return (f"PowerSGD rank {self.rank} from step {self.start_step}: "
            f"{len(self._errors)} of {len(self._shapes)} gradients "
            f"compressed, {sent:,} of {plain:,} values all-reduced per step "
            f"({plain / sent:.1f}x fewer)")

  def compressed_from(self, step):
    return compressed_from(self, step)

  @property
  def compressed_indices(self):
    return sorted(self._errors)

  def reset(self):
    """Zero error buffers and fresh Qs (after a restore: the buffers of the
    run that wrote the checkpoint are gone)."""
    for i, error in self._errors.items():
      error.assign(tf.zeros_like(error))
      m, r = self._qs[i].shape
      self._qs[i].assign(self._initial_q(m, r, self._seed, i))

  def reduce(self, grads, compressed=True):
    """Sums `grads` over replicas: PowerSGD for the big matrices when
    `compressed`, else (before start_step) the plain all-reduce."""
    context = tf.distribute.get_replica_context()
    if (not compressed or context is None
        or context.num_replicas_in_sync == 1):
      return self._plain.reduce(grads)
    result = list(grads)
    squeezed = {}  # index -> M with the error added
    plain = []
    for i, grad in enumerate(grads):
      if grad is None:
        continue
      if i in self._errors and not isinstance(grad, tf.IndexedSlices):
        squeezed[i] = tf.reshape(tf.cast(grad, tf.float32),
                                 self._errors[i].shape) + self._errors[i]
      else:
        plain.append(i)
    order = sorted(squeezed)
    ps = [tf.matmul(squeezed[i], self._qs[i]) for i in order]
    # First collective: every P and every tensor sent as it is.
    reduced = _sum_in(context, ps + [grads[i] for i in plain], self._wire)
    for i, total in zip(plain, reduced[len(order):]):
      result[i] = total
    bases = [tf.linalg.qr(p, full_matrices=False).q for p in reduced[:len(order)]]
    local_qs = [tf.matmul(squeezed[i], basis, transpose_a=True)
                for i, basis in zip(order, bases)]
    # Second collective: every Q.
    summed_qs = _sum_in(context, local_qs, self._wire)
    for i, basis, local_q, q in zip(order, bases, local_qs, summed_qs):
      # What this replica's M lost to the shared projection.
      self._errors[i].assign(
          squeezed[i] - tf.matmul(basis, local_q, transpose_b=True))
      self._qs[i].assign(q)
      result[i] = tf.cast(
          tf.reshape(tf.matmul(basis, q, transpose_b=True), grads[i].shape),
          grads[i].dtype)
    return result


def create(config, variables):
  """The reducer `config` asks for (call under the strategy's scope)."""
  if config.allreduce_compression == "powersgd":
    return PowerSGDReducer(variables=variables, rank=config.powersgd_rank,
                           start_step=config.powersgd_start_step,
                           dtype=config.allreduce_dtype, seed=config.seed,
                           overlap=config.overlap_allreduce,
                           pack_bytes=config.bytes_per_pack)
  if config.allreduce_compression == "none":
    return PlainReducer(dtype=config.allreduce_dtype,
                        overlap=config.overlap_allreduce,
                        pack_bytes=config.bytes_per_pack)
  valid = options.BY_NAME["allreduce_compression"].choices
  raise ValueError(f"Unrecognized allreduce_compression: "
                   f"{config.allreduce_compression!r}. Valid: "
                   f"{', '.join(valid)}.")
