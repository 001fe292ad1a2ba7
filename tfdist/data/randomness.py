"""Every random draw of the input: shuffles and augmentation.

Shuffles take their seed from the run's seed and the epoch (or window)
alone, so that any seed, 0 included, gives one order on every host and in
every process. Augmentation is keyed by the example's place in its stream:

- an augment that takes a `seed` keyword gets, for each example, a
  stateless seed (shape [2], int64) from (run seed, stream, position):
  reproducible, different on every host that reads a stream of its own,
  new each epoch, and continued, not replayed, after a resume (Grain's
  way; use tf.random.stateless_* and tf.image.stateless_random_*);
- an augment that draws with TF's stateful ops (tf.image.random_flip_*)
  gets a graph seed from (run seed, stream, start position): it differs
  between hosts and after a resume, but it is not tied to the example
  (on the tf.data service, and for asynchronous workers, it is drawn
  anew wherever the pipeline runs).
"""

import contextlib
import inspect

import tensorflow as tf

_MIX = 1_000_003  # Folds a second number into a seed.
_MAX_SEED = 2**31 - 1  # TF's graph seeds are truncated to int32.


def epoch_seed(seed, epoch):
  """One seed for (seed, epoch): a shuffle's seed in each epoch."""
  return seed * _MIX + epoch


def seed_of(seed, epoch):
  """epoch_seed as an int64 tensor (seed None: the clock's, see
  seed_tensor)."""
  return epoch_seed(seed_tensor(seed), tf.cast(epoch, tf.int64))


def seed_tensor(seed):
  """The run's seed as an int64 tensor; `None` (asynchronous workers, each
  with an order of its own): drawn from the clock where the pipeline
  runs, since the function is traced once and shipped to every worker."""
  if seed is None:
    return tf.cast(tf.timestamp() * 1e6, tf.int64)
  return tf.cast(seed, tf.int64)


@contextlib.contextmanager
def _graph_seed(value):
  """The traced function's own graph seed, for what is drawn inside it.

  TF pairs an op seed with the graph's seed and tests the pair against
  (0, 0) in Python: with a graph seed of 0 (tf.random.set_seed(0), which
  keras.utils.set_random_seed(0) calls) an op seed that is a tensor is
  used as a bool, and tracing fails. Inside a function that tfdist traces
  the graph is its own, so its seed is set for the call and put back.
  Eagerly there is no such test to fail.
  """
  if tf.executing_eagerly():
    yield
    return
  graph = tf.compat.v1.get_default_graph()
  saved = graph.seed
  graph.seed = value
  try:
    yield
  finally:
    graph.seed = saved


def shuffle(dataset, buffer, seed, *, reshuffle=False):
  """`dataset.shuffle(buffer)` in an order decided by `seed` (an int64
  tensor) alone, whatever the process's global seed."""
  with _graph_seed(None):
    return dataset.shuffle(buffer, seed=seed,
                           reshuffle_each_iteration=reshuffle)


def takes_seed(augment):
  """Whether `augment` takes a `seed` keyword (stateless draws)."""
  try:
    parameters = inspect.signature(augment).parameters
  except (TypeError, ValueError):
    return False
  return "seed" in parameters


def example_seed(seed, stream, position):
  """The stateless seed of the example at `position` of `stream`."""
  return tf.stack([epoch_seed(seed_tensor(seed), tf.cast(stream, tf.int64)),
                   tf.cast(position, tf.int64)])


def draw(augment, *, seed, stream, start, apart=0):
  """(position, example) -> the example augmented, its draws keyed as
  the module docstring says, for the stream `stream` read from `start`
  on; the example itself when there is no augment. `apart`: stateful
  draws of hosts that augment slices of one stream differ by it."""
  if augment is None:
    return lambda position, example: example
  if takes_seed(augment):
    if seed is None:  # No place in a stream keys the draw.
      return lambda position, example: augment(*example,
                                               seed=_drawn_seed())
    return lambda position, example: augment(
        *example, seed=example_seed(seed, stream, position))
  graph_seed = None  # Drawn anew where it runs.
  if all(isinstance(n, int) for n in (seed, stream, start, apart)):
    graph_seed = epoch_seed(epoch_seed(epoch_seed(seed, stream), start),
                            apart) % _MAX_SEED

  def drawn(position, example):
    del position  # Stateful ops draw in the order they run.
    with _graph_seed(graph_seed):
      return augment(*example)
  return drawn


def _drawn_seed():
  """A stateless seed drawn anew for each example, where no place in a
  stream keys it (a clock's would repeat within a microsecond)."""
  with _graph_seed(None):
    return tf.random.uniform([2], 0, 2**62, dtype=tf.int64)


def augmented(examples, augment, *, seed, stream, start):
  """`examples` (the stream `stream` from its position `start` on) with
  `augment` applied."""
  if augment is None:
    return examples
  return examples.enumerate(start).map(
      draw(augment, seed=seed, stream=stream, start=start),
      num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
