"""The gradient all-reduce overlapped with the backward pass: packs in
reverse layer order, checked in a profiler trace of a real 2-worker
MultiWorkerMirrored job, and the same weights as without overlap."""

import statistics

import pytest

import artifacts
from conftest import run_launcher
from tfdist import compression
from tools import overlap_trace


def test_packs_go_last_layer_first_with_a_smaller_first_pack():
  sizes = [100, 40, 40, 40, 300, 10]  # Bytes per gradient, layer order.
  packs = compression.plan_packs(sizes, pack_bytes=120, first_pack_bytes=50)
  assert packs == [[5], [4], [3, 2, 1], [0]]
  # A gradient larger than a pack goes alone; every index exactly once.
  assert compression.plan_packs([500, 10], pack_bytes=100) == [[1], [0]]
  assert compression.plan_packs(sizes, pack_bytes=None) == [[5, 4, 3, 2, 1, 0]]
  assert compression.plan_packs([], pack_bytes=10) == []


def test_reducer_packs_skip_missing_and_sparse_gradients():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  grads = [tf.zeros([64, 64]), None, tf.zeros([64]),
           tf.IndexedSlices(tf.zeros([2, 4]), tf.constant([0, 3]),
                            tf.constant([10, 4])), tf.zeros([300, 300])]
  reducer = compression.PlainReducer(pack_bytes=20_000)
  # 300x300 floats (360 KB) exceed the first pack alone; 64 + 64x64
  # floats (16.6 KB) fit one pack.
  assert reducer.packs_for(grads) == [[4], [2, 0]]
  assert compression.PlainReducer(overlap=False).packs_for(grads) == [
      [4, 2, 0]]
  with pytest.raises(ValueError, match="pack_bytes=-1"):
    compression.PlainReducer(pack_bytes=-1)


def _profiled_run(model_dir, data_dir, *extra):
  run_launcher(["--workers=2", "--isolate=off"], [
      "--strategy=multi_worker_mirrored", "--model=resnet20",
      "--dataset=digits", f"--data_dir={data_dir}",
      f"--model_dir={model_dir}", "--train_steps=30", "--steps_per_loop=10",
      "--log_every=10", "--batch_size=32", "--eval_every=0",
      "--noexport", "--profile_steps=10,20", *extra])
  return overlap_trace.steps(overlap_trace.find_trace(str(model_dir)))


def test_first_allreduce_starts_before_the_last_gradient_op(tmp_path,
                                                           data_dir):
  overlapped = _profiled_run(tmp_path / "on", data_dir)
  serial = _profiled_run(tmp_path / "off", data_dir,
                         "--nooverlap_allreduce")
  assert len(overlapped) == len(serial) == 10
  # resnet20's 1.1 MB of gradients: a 256 KiB first pack, then the rest.
  assert {s.packs for s in overlapped} == {2}
  assert {s.packs for s in serial} == {1}
  # Without overlap no gradient op can follow the all-reduce: it needs
  # them all. With it, the first pack leaves while most of the backward
  # pass is still to run (in the runs we saw: all 10 steps, with a median
  # of 86% of the gradient ops after the first all-reduce; the executor
  # may delay one now and then, so 8 steps and half the ops are asked for).
  assert not any(s.overlapped for s in serial)
  assert sum(s.overlapped for s in overlapped) >= 8, overlapped
  shares = [s.gradient_ops_after_first_allreduce / s.gradient_ops
            for s in overlapped]
  assert statistics.median(shares) > 0.5, overlapped
  artifacts.assert_weights_close(artifacts.model_weights(tmp_path / "on"),
                                 artifacts.model_weights(tmp_path / "off"),
                                 rtol=1e-5)
