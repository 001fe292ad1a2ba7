"""The order of a split streamed from files, and where a resumed input
pipeline starts.

Epoch e permutes the files with (seed, e); pipeline h of N reads files h,
h + N, ... of that permutation. It reads them in rounds of CYCLE files,
interleaved record by record, and shuffles each window of `window`
records with (seed, e, window index). Nothing but the seed, the epoch,
the record counts and N decides the order, so the place after k records
is arithmetic: whole epochs and whole files are skipped without being
opened, a file being read skips its first records without parsing them,
and only the current window is read again. Nothing is saved in the
checkpoint but the step: the shuffle buffer is not state.
"""

import dataclasses

import tensorflow as tf

from tfdist.data import randomness

CYCLE = 8  # Files read at once by one pipeline.
FOREVER = 2**62  # Epochs: more than any run takes.


def file_order(num_files, seed, epoch):
  """The files' order in `epoch` (a tensor: the same in a graph and
  eagerly, since the shuffle is stateless)."""
  return tf.random.experimental.stateless_shuffle(
      tf.range(num_files, dtype=tf.int64),
      seed=tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)]))


def host_files(num_files, seed, epoch, hosts, host):
  """Indices of the files pipeline `host` of `hosts` reads in `epoch`."""
  return [int(i) for i in file_order(num_files, seed, epoch).numpy()
          [host::hosts]]


def epoch_length(counts, seed, epoch, hosts):
  """Records each pipeline trains on in `epoch`: the fewest any pipeline's
  files hold, so that all stay in the same epoch (each pipeline leaves out
  the rest of its own, other records every epoch)."""
  permuted = file_order(len(counts), seed, epoch).numpy()  # Once: hosts
  return min(sum(counts[i] for i in permuted[host::hosts])  # slice it.
             for host in range(hosts))


def left_out_share(counts, hosts, seed, epochs=4):
  """The share of records an epoch leaves out on `hosts` pipelines (the
  mean of the run's first `epochs`: what file sharding costs)."""
  total = sum(counts)
  seed = 0 if seed is None else seed  # Asynchronous: any order is typical.
  return sum(total - hosts * epoch_length(counts, seed, e, hosts)
             for e in range(epochs)) / (epochs * total)


def _epoch_length_tensor(counts, order, hosts):
  """epoch_length for a file order given as a tensor (counts: a list or
  an int64 tensor)."""
  counts = tf.convert_to_tensor(counts, tf.int64)
  owners = tf.range(tf.size(counts, out_type=tf.int64)) % hosts
  sizes = tf.math.unsorted_segment_sum(tf.gather(counts, order), owners,
                                       hosts)
  return tf.reduce_min(sizes)


def locate(counts, seed, hosts, host, position):
  """(epoch, records into it) of pipeline `host` after `position`
  records: one graph call, however many epochs it walks."""
  del host  # Every pipeline's epoch has the same length.
  if hosts == 1:  # Every epoch holds every record.
    return divmod(position, sum(counts))
  epoch, into = _walk_epochs(tf.constant(counts, tf.int64),
                             tf.constant(seed, tf.int64),
                             tf.constant(hosts, tf.int64),
                             tf.constant(position, tf.int64))
  return int(epoch), int(into)


@tf.function(reduce_retracing=True)
def _walk_epochs(counts, seed, hosts, position):
  """The epochs whole before `position`, and the records left."""
  num_files = tf.size(counts, out_type=tf.int64)
  epoch = tf.constant(0, tf.int64)
  size = _epoch_length_tensor(counts, file_order(num_files, seed, epoch),
                              hosts)
  while position >= size:
    position -= size
    epoch += 1
    size = _epoch_length_tensor(counts, file_order(num_files, seed, epoch),
                                hosts)
  return epoch, position


def resume_round(counts, consumed):
  """Where a round of files, read record by record in turn, stands after
  `consumed` records: [(file in the round, records it gave)] for each file
  not finished, in the order reading goes on."""
  low, high = 0, max(counts)
  # k: the number of whole turns taken, the largest with T(k) <= consumed.
  while low < high:
    middle = (low + high + 1) // 2
    if sum(min(c, middle) for c in counts) <= consumed:
      low = middle
    else:
      high = middle - 1
  turns = low
  extra = consumed - sum(min(c, turns) for c in counts)
  longer = [i for i, c in enumerate(counts) if c > turns]
  start = longer[extra]  # The next record's file: the turn goes on there.
  given = [min(c, turns) + (1 if i in longer[:extra] else 0)
           for i, c in enumerate(counts)]
  rotated = list(range(start, len(counts))) + list(range(start))
  return [(i, given[i]) for i in rotated if given[i] < counts[i]]


def interleave(paths, skips, split):
  """Records of up to CYCLE files, one from each in turn, each file after
  its first `skips` records. Read in parallel only from remote storage:
  on a local disk, threads handing records over cost more CPU than they
  save (0.8x a hand-written loop's images/s on 2 cores, where sequential
  reads keep up; tools/bench_file_rate). The order is the same."""
  return tf.data.Dataset.from_tensor_slices((paths, skips)).interleave(
      lambda path, skip: split.reader(path).skip(skip), cycle_length=CYCLE,
      block_length=1,
      num_parallel_calls=tf.data.AUTOTUNE if split.remote else None,
      deterministic=True)


def _rounds(all_paths, indices, split):
  """Records of the files `indices` (a tensor), CYCLE at a time."""
  def one_round(round_indices):
    paths = tf.gather(all_paths, round_indices)
    return interleave(paths, tf.zeros_like(round_indices), split)
  return tf.data.Dataset.from_tensor_slices(indices).batch(CYCLE).flat_map(
      one_round)


def _window_seed(seed, epoch, window_index):
  """The shuffle seed of one window: a stateless draw from (seed, epoch,
  window), the same on every host and in every process."""
  return tf.random.stateless_uniform(
      [], seed=tf.stack([
          randomness.epoch_seed(tf.cast(seed, tf.int64), epoch),
          window_index]),
      minval=0, maxval=2**62, dtype=tf.int64)


def _shuffle_windows(records, seed, epoch, window, first_window):
  """Each window of `window` records in an order of its own. `window`
  buffers a window's records and a fixed-seed `shuffle` of the same size
  permutes them without copying (batching and gathering held three
  copies). The next window is read while this one drains: two windows in
  memory, and the parse is not left idle while a window fills (1.49
  cores busy on 2, against 1.38)."""
  def permute(index, records_of_window):
    return randomness.shuffle(
        records_of_window, window,
        _window_seed(seed, epoch, first_window + index))
  return records.window(window).prefetch(1).enumerate().flat_map(permute)


@dataclasses.dataclass(frozen=True)
class Place:
  """Where one pipeline's stream resumes, worked out eagerly (a dataset
  function traced for parameter-server workers cannot read tensors).
  `round_left`: ((path, records already given), ...) of the files of the
  round in progress at the window's start; `later`: the epoch's files
  after that round."""

  epoch: int
  into: int  # Records of the epoch already trained on.
  length: int  # Records of the epoch this pipeline trains on.
  first_window: int
  round_left: tuple
  later: tuple


def place(split, *, seed, hosts, host, position, window):
  """The Place of pipeline `host` of `hosts` after `position` records."""
  epoch, into = locate(split.counts, seed, hosts, host, position)
  mine = host_files(len(split.paths), seed, epoch, hosts, host)
  first_window = into // window
  start = first_window * window
  rounds = [mine[i:i + CYCLE] for i in range(0, len(mine), CYCLE)]
  done = 0
  for number, files in enumerate(rounds):
    size = sum(split.counts[i] for i in files)
    if start < done + size:
      break
    done += size
  left = resume_round([split.counts[i] for i in files], start - done)
  return Place(epoch=epoch, into=into,
               length=epoch_length(split.counts, seed, epoch, hosts),
               first_window=first_window,
               round_left=tuple((split.paths[files[i]], given)
                                for i, given in left),
               later=tuple(i for files in rounds[number + 1:]
                           for i in files))


def records(split, *, seed, hosts, host, window, start=None):
  """Serialized records of pipeline `host` of `hosts`, for ever, from its
  Place `start` on (None: the beginning). `seed=None`: an order of the
  pipeline's own, from the start (asynchronous workers). Builds the
  dataset only: no tensor is read, so it traces."""
  all_paths = tf.constant(split.paths)
  num_files = len(split.paths)

  def epoch_records(epoch):
    seed_of_run = randomness.seed_tensor(seed)
    order = file_order(num_files, seed_of_run, epoch)
    return _shuffle_windows(
        _rounds(all_paths, order[host::hosts], split), seed_of_run,
        epoch, window, 0).take(
            _epoch_length_tensor(split.counts, order, hosts))

  if start is None:
    return tf.data.Dataset.range(FOREVER).flat_map(epoch_records)
  first = _resumed_epoch(split, seed, start, window)
  return first.skip(start.into % window).take(
      start.length - start.into).concatenate(
          tf.data.Dataset.range(start.epoch + 1, FOREVER).flat_map(
              epoch_records))


def _resumed_epoch(split, seed, start, window):
  """The epoch of Place `start` from its first window on."""
  paths, given = zip(*start.round_left)
  current = interleave(tf.constant(paths), tf.constant(given, tf.int64),
                       split)
  if start.later:
    current = current.concatenate(_rounds(
        tf.constant(split.paths), tf.constant(start.later, tf.int64), split))
  return _shuffle_windows(current, tf.constant(seed, tf.int64), start.epoch,
                          window, start.first_window)
