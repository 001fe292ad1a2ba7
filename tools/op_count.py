"""Counts the ops one training step executes: tfdist's compiled loop
against the minimal hand-written loop (tools.baseline), same model.

python -m tools.op_count [--model=mlp] [--batch_size=256]

It traces each loop function and counts the nodes of the while-loop body
(one step), including the functions the body calls, by op type.
"""

import collections

from absl import app
from absl import flags

from . import baseline
from . import inprocess

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "mlp", "Zoo model.")
flags.DEFINE_integer("batch_size", 256, "Global batch.")


def _count_body(graph):
  """{op type: count} of the largest while body in `graph`'s library."""
  library = {f.signature.name: f for f in
             graph.as_graph_def().library.function}

  def count(name, seen):
    counts = collections.Counter()
    for node in library[name].node_def:
      counts[node.op] += 1
      for attr in ("f", "body", "then_branch", "else_branch"):
        if attr in node.attr and node.attr[attr].func.name in library:
          callee = node.attr[attr].func.name
          if callee not in seen:
            counts.update(count(callee, seen | {callee}))
      if node.op in library and node.op not in seen:
        counts.update(count(node.op, seen | {node.op}))
    return counts

  bodies = [n for n in library if "while_body" in n]
  return max((count(b, {b}) for b in bodies), key=lambda c: sum(c.values()))


def main(argv):
  del argv
  import keras
  import tensorflow as tf
  from tfdist import data
  from tfdist import models
  config = inprocess.bench_config(model=FLAGS.model,
                                  batch_size=FLAGS.batch_size,
                                  steps_per_loop=8)
  info = inprocess.start(config)
  trainer = inprocess.build_trainer(config, info)
  runner = trainer._runner  # pylint: disable=protected-access
  iterator = runner.make_iterator(data.inputs_from_dataset(
      data.load(config), global_batch_size=config.batch_size,
      seed=1).train_fn(0, 1))
  tfdist_graph = runner._train.get_concrete_function(  # pylint: disable=protected-access
      iterator, tf.constant(8)).graph

  dataset = data.load(config)
  model = models.build(config.model, input_shape=dataset.input_shape,
                       num_classes=dataset.num_classes)
  model(tf.zeros([1, *dataset.input_shape]))
  optimizer = keras.optimizers.Adam(1e-3)
  optimizer.build(model.trainable_variables)
  loop = baseline.loop_function(info.strategy, model, optimizer,
                                config.batch_size)
  hand_graph = loop.get_concrete_function(iterator, tf.constant(8)).graph

  counts = {"tfdist": _count_body(tfdist_graph),
            "hand-written": _count_body(hand_graph)}
  print("| op | tfdist | hand-written |")
  print("|---|---:|---:|")
  for op in sorted(set(counts["tfdist"]) | set(counts["hand-written"]),
                   key=lambda o: -counts["tfdist"][o]):
    a, b = counts["tfdist"][op], counts["hand-written"][op]
    if a != b:
      print(f"| {op} | {a} | {b} |")
  print(f"| **all ops per step** | {sum(counts['tfdist'].values())} | "
        f"{sum(counts['hand-written'].values())} |")


if __name__ == "__main__":
  app.run(main)
