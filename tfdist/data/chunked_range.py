"""A pipeline whose source is a `Dataset.range`, rebuilt with its range
split in chunks, for the tf.data service (tfdist.data.service_units).

Under ShardingPolicy.DYNAMIC the dispatcher hands a range's splits to the
data workers one element each, an RPC per example: a CPU-heavy
range(n).map(heavy) was served at 1.37x the trainer's own input, against
1.83x with its range in chunks of 64 (tools/bench_data_service). The
rebuilt pipeline is range(start, stop, step * K).flat_map(a range of K),
so a split is K examples, in the same order as the original's.
"""

from absl import logging
import tensorflow as tf

from tfdist import errors
from tfdist.data import sources

CHUNK = 64  # Examples per split, at most.
# A pipeline's graph above this carries data (arrays it captured).
MAX_GRAPH_BYTES = 16 << 20
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_PREFIX = "tfdist_chunked/"


def _constant(nodes, name):
  """The value of the Const node an input names; None for any other."""
  node = nodes.get(name.lstrip("^").split(":")[0])
  if node is None or node.op != "Const":
    return None
  return int(tf.make_ndarray(node.attr["value"].tensor))


def _chunk_graph(start, stop, step, chunk, dtype):
  """The GraphDef of the chunked range; its output node's name."""
  span = step * chunk
  bound = tf.minimum if step > 0 else tf.maximum
  chunks = tf.data.Dataset.range(start, stop, span).flat_map(
      lambda first: tf.data.Dataset.range(
          first, bound(first + span, stop), step, output_type=dtype))
  graph = sources.pipeline_graph(chunks)
  outputs = [node.input[0] for node in graph.node if node.op == "_Retval"]
  if len(outputs) != 1:  # A release that serializes otherwise.
    raise ValueError(f"DatasetToGraphV2 gave {len(outputs)} _Retval nodes")
  return graph, outputs[0]


def _splice(graph, node, replacement, output):
  """`graph` with `node` replaced by `replacement`'s nodes, the one named
  `output` taking `node`'s name; None where a function's name clashes."""
  theirs = {function.signature.name: function
            for function in graph.library.function}
  for function in replacement.library.function:
    if theirs.get(function.signature.name, function) != function:
      return None
    if function.signature.name not in theirs:
      graph.library.function.add().CopyFrom(function)
  graph.node.remove(node)
  for new in replacement.node:
    if new.op == "_Retval":
      continue
    added = graph.node.add()
    added.CopyFrom(new)
    added.name = node.name if new.name == output else _PREFIX + new.name
    added.input[:] = [_renamed(name) for name in new.input]
  return graph


def _renamed(name):
  """An input's name under the prefix; a control input keeps its '^'."""
  return ("^" + _PREFIX + name[1:] if name.startswith("^")
          else _PREFIX + name)


def _range_of(graph):
  """(start, stop, step, dtype) of the graph's one RangeDataset node, and
  the node; None where there is not exactly one or its bounds are not
  constants."""
  ranges = [node for node in graph.node if node.op == "RangeDataset"]
  if len(ranges) != 1:
    return None
  nodes = {node.name: node for node in graph.node}
  bounds = [_constant(nodes, name) for name in ranges[0].input[:3]]
  if None in bounds:
    return None
  (dtype,) = ranges[0].attr["output_types"].list.type
  return (*bounds, tf.as_dtype(dtype)), ranges[0]


def _chunk_size(start, stop, step):
  """Examples per split: up to CHUNK, with at least CHUNK splits; 1 where
  a chunk's end would leave int64."""
  length = ((abs(stop - start) + abs(step) - 1) // abs(step)
            if (stop - start) * step > 0 else 0)  # len() stops at 2**63.
  chunk = min(CHUNK, length // CHUNK)
  span = step * chunk
  return chunk if _INT64_MIN <= stop + span <= _INT64_MAX else 1


def chunked(dataset):
  """`dataset` rebuilt with its one `range` source in chunks of up to
  CHUNK examples; `dataset` itself where there is no such range (more
  than one, or bounds that are not constants), where it has fewer than
  128 examples, where the pipeline carries data of its own (a graph over
  MAX_GRAPH_BYTES: the rebuild would hold several copies of it), or
  while a function is traced (its graph is read eagerly)."""
  if not tf.executing_eagerly():
    return dataset
  graph = sources.pipeline_graph(dataset)
  if graph is None or graph.ByteSize() > MAX_GRAPH_BYTES:
    return dataset
  found = _range_of(graph)
  if found is None:
    return dataset
  (start, stop, step, dtype), node = found
  size = _chunk_size(start, stop, step)
  if size < 2:
    return dataset
  try:
    spliced = _splice(graph, node,
                      *_chunk_graph(start, stop, step, size, dtype))
    if spliced is None:
      return dataset
    return tf.data.experimental.from_variant(
        tf.raw_ops.DatasetFromGraph(graph_def=spliced.SerializeToString()),
        dataset.element_spec)
  except (ValueError, tf.errors.OpError) as e:
    logging.warning("The range of %s is split one example at a time (its "
                    "rebuild in chunks failed: %s).", dataset,
                    errors.first_line(e))
    return dataset
