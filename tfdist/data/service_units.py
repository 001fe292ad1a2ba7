"""The stream a tf.data service job serves, cut into units the dispatcher
hands out one at a time (tfdist.data.service).

Unit u is slice u % S of epoch u // S. A slice of a split read from files
is every S-th file of the epoch's file order, interleaved and shuffled
within the slice; a slice of other data is every S-th example of the
epoch's shuffle (each unit runs the whole pipeline to keep its slice).
A pipeline of your own, or data in memory, whose one source TF can split
(sources.splits_by_source) is served whole instead, an epoch a unit:
DYNAMIC hands its source's splits (elements, or files) to the data
workers, so each example is parsed once. Each unit is read whole by one
data worker and shuffled on its own, so units never mix: under
round-robin reads, with S a multiple of the data workers and slices of
equal size, an epoch's units end together. A resume starts the epoch
the stream is in again: the stream then runs behind the step count (the
lag, which the checkpoint keeps, so that a second resume finds the
stream's own epoch).
"""

from absl import logging
import tensorflow as tf

from tfdist.data import chunked_range
from tfdist.data import order
from tfdist.data import randomness
from tfdist.data import sources

SLICE_FILES = 4  # Files per unit of a dynamic epoch read from many files.
# Units per epoch, where the data allows: one unit an epoch would let 2
# data workers read 2 epochs at once, and a resume taken as the later one
# would skip the rest of the earlier.
MIN_SLICES = 4


def slices_per_epoch(dataset):
  """S: units per epoch."""
  split = dataset.file_split
  if split is not None:
    # Fewer than SLICE_FILES * MIN_SLICES files: a file or two per unit.
    return max(len(split.paths) // SLICE_FILES,
               min(len(split.paths), MIN_SLICES))
  if dataset.num_train_examples is None or by_source(dataset):
    return 1
  # A slice of a stream reads all of it (4 times the reads).
  return max(1, min(MIN_SLICES, dataset.num_train_examples))


def _shuffled(dataset, buffer):
  """The shuffle buffer: no larger than the data."""
  size = dataset.num_train_examples
  return min(size, buffer) if size else buffer


def by_source(dataset):
  """Whether the service splits the pipeline's own source among its data
  workers (see the module docstring)."""
  return dataset.train_pipeline is not None and sources.splits_by_source(
      dataset.train_pipeline())


def _by_source_stream(dataset, *, mode, seed, first_epoch, buffer):
  """The pipeline shuffled anew each epoch and repeated, from
  `first_epoch` on. `dynamic`: the dispatcher hands the source's splits
  to the data workers, each shuffling what it reads; `parallel_epochs`:
  each data worker reads all of it, in an order of its own (a seed drawn
  where it runs). Augmentation draws anew where it runs: no example's
  place in the stream is known."""
  shuffled = _shuffled(dataset, buffer)

  def epochs(run_seed):
    # Only `dynamic` splits the source: a range's splits in chunks.
    pipeline = dataset.train_pipeline()
    if mode == "dynamic":
      pipeline = chunked_range.chunked(pipeline)
    return randomness.shuffle(
        pipeline, shuffled,
        randomness.seed_of(run_seed, first_epoch), reshuffle=True).repeat()
  if mode == "parallel_epochs":
    examples = tf.data.Dataset.range(1).map(
        lambda _: randomness.seed_tensor(None)).flat_map(epochs)
  else:
    examples = epochs(tf.constant(seed, tf.int64))
  return randomness.augmented(examples, dataset.augment, seed=None,
                              stream=0, start=0)


def _file_unit(split, slices, buffer):
  paths = tf.constant(split.paths)
  num_files = len(split.paths)

  def records(unit, seed):
    epoch, part = unit // slices, unit % slices
    files = order.file_order(num_files, seed, epoch)[part::slices]
    chosen = tf.gather(paths, files)
    records_ = order.interleave(chosen, tf.zeros_like(files), split)
    return randomness.shuffle(
        records_, buffer, randomness.seed_of(seed, unit)).map(
            split.parse, num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True)
  return records


def _example_unit(dataset, slices, buffer):
  shuffled = _shuffled(dataset, buffer)

  def examples(unit, seed):
    epoch, part = unit // slices, unit % slices
    # The same seed for every slice of an epoch: one permutation, cut.
    return randomness.shuffle(
        dataset.train_source(), shuffled,
        randomness.seed_of(seed, epoch)).shard(slices, part)
  return examples


def resume_point(dataset, *, trained, lag):
  """(unit, lag): where the stream starts again after `trained` examples
  of steps, when it ran `lag` examples behind them: the first unit of the
  epoch the stream is in, and the stream's lag from then on. Several data
  workers read several units at once, so no later unit is known to be
  used up: the epoch's examples trained before the stop are trained
  again, and none is skipped where an epoch's units end together (see
  above; otherwise a data worker may still be in the epoch before)."""
  total = (sum(dataset.file_split.counts) if dataset.file_split is not None
           else dataset.num_train_examples)
  if total is None:
    if trained:
      logging.warning("%s: its size is unknown, so a resume on the tf.data "
                      "service starts its epochs again.", dataset.name)
    return 0, trained
  # Never before the first example (a lag kept at a larger batch size).
  epoch, into = divmod(max(trained - lag, 0), total)
  if into:
    logging.info("Input: the resume at example %d of epoch %d reads that "
                 "epoch again from its start on the tf.data service.", into,
                 epoch)
  lag = trained - epoch * total
  if lag >= total:
    logging.warning(
        "Input: the tf.data service's stream is %.1f epochs behind the step "
        "count: each resume read the epoch in progress again, so the run "
        "trains that many epochs fewer than its steps count.", lag / total)
  return epoch * slices_per_epoch(dataset), lag


def _augmented_unit(unit, augment, resume):
  """Each unit's examples augmented, keyed by (seed, resume, unit, place
  in the unit): a unit is read whole by one data worker, so its keys are
  the same whoever reads it; a resume (`resume`: its step), which reads
  the epoch in progress again, draws anew."""
  def examples(unit_index, seed):
    return randomness.augmented(
        unit(unit_index, seed), augment,
        seed=randomness.seed_of(seed, resume), stream=unit_index, start=0)
  return examples


def served_examples(dataset, *, mode, seed, first_unit, buffer, resume=0):
  """Parsed, augmented, unbatched examples in units (see the module
  docstring)."""
  if by_source(dataset):
    return _by_source_stream(dataset, mode=mode, seed=seed,
                             first_epoch=first_unit, buffer=buffer)
  slices = slices_per_epoch(dataset)
  split = dataset.file_split
  unit = _augmented_unit(
      _file_unit(split, slices, buffer) if split is not None
      else _example_unit(dataset, slices, buffer), dataset.augment, resume)
  if mode == "parallel_epochs":
    # Each data worker runs the whole stream in an order of its own: a
    # seed drawn where it runs.
    seeds = tf.data.Dataset.range(1).map(
        lambda _: randomness.seed_tensor(None))
    examples = seeds.flat_map(lambda s: tf.data.Dataset.range(
        order.FOREVER).flat_map(lambda u: unit(u, s)))
  else:
    examples = tf.data.Dataset.range(
        first_unit, order.FOREVER).flat_map(
            lambda u: unit(u, tf.constant(seed, tf.int64)))
  return examples


def served_batches(dataset, *, mode, seed, first_unit, batch_size, buffer,
                   resume=0):
  """`resume`: the step the run resumed at, which keys augmentation."""
  examples = served_examples(dataset, mode=mode, seed=seed,
                             first_unit=first_unit, buffer=buffer,
                             resume=resume)
  return examples.batch(batch_size, drop_remainder=True)
