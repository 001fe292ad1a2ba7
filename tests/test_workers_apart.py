"""MWMS workers started by hand, as on SSH hosts or pods without a common
volume: each with its own model_dir (no shared disk), and a peer that
stalls. The test is the launcher here: it writes each TF_CONFIG itself."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import portpicker
import pytest

import artifacts
from conftest import ROOT
from conftest import run_launcher
from tfdist import cluster

MWMS = ["--strategy=multi_worker_mirrored", "--model=mlp",
        "--dataset=digits", "--batch_size=64", "--steps_per_loop=10",
        "--log_every=20", "--eval_every=0", "--checkpoint_every=50"]


class Workers:
  """Two MWMS worker processes; worker i writes its output to a file."""

  def __init__(self, tmp_path, model_dirs, args, module="tfdist.train",
               env=None):
    ports = [portpicker.pick_unused_port() for _ in model_dirs]
    configs = cluster.build_tf_configs(
        {"worker": [f"127.0.0.1:{port}" for port in ports]})
    self.logs = [tmp_path / f"worker{i}.log" for i in range(len(ports))]
    self.procs = []
    for i, model_dir in enumerate(model_dirs):
      with open(self.logs[i], "w") as out:
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", module, *MWMS, *args,
             f"--model_dir={model_dir}"], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ,
                 "TF_CONFIG": json.dumps(configs[("worker", i)]),
                 **(env or {})}))

  def output(self, i):
    return self.logs[i].read_text()

  def wait_for(self, i, text, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if text in self.output(i):
        return
      time.sleep(0.2)
    raise AssertionError(f"worker {i} never printed {text!r}:\n"
                         + self.output(i)[-3000:])

  def finish(self, timeout=300):
    codes = [p.wait(timeout=timeout) for p in self.procs]
    return codes

  def kill(self):
    for proc in self.procs:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("extra", [[], ["--shard_optimizer"],
                                   ["--shard=params"]],
                         ids=["plain", "shard_optimizer", "shard_params"])
def test_workers_without_a_shared_disk_take_the_chiefs_state(tmp_path,
                                                             data_dir,
                                                             extra):
  """The chief's model_dir holds ckpt-100, worker 1's is empty. Worker 1
  takes the chief's weights, slots and step, says so, and the run ends
  with the weights of the same resume on a shared model_dir. Sharded
  (Adam's moments split between the workers), worker 1 takes its shard
  of the chief's restored moments (with --shard=params, of its weights
  too)."""
  shared = str(tmp_path / "shared")
  run_launcher(["--workers=2"], [*MWMS, *extra, f"--data_dir={data_dir}",
                                 "--train_steps=100",
                                 f"--model_dir={shared}"])
  chief_dir, reference = tmp_path / "chief", tmp_path / "reference"
  shutil.copytree(shared, chief_dir)
  shutil.copytree(shared, reference)
  run_launcher(["--workers=2"], [*MWMS, *extra, f"--data_dir={data_dir}",
                                 "--train_steps=160",
                                 f"--model_dir={reference}"])

  workers = Workers(tmp_path, [chief_dir, tmp_path / "empty"],
                    [*extra, f"--data_dir={data_dir}", "--train_steps=160",
                     "--collective_timeout=120"])
  try:
    codes = workers.finish()
  finally:
    workers.kill()
  assert codes == [0, 0], workers.output(0)[-2000:] + workers.output(1)[-2000:]
  assert f"Resumed from {chief_dir}/ckpt-100 at step 100" in workers.output(0)
  assert re.search(r"This worker restored no checkpoint, at step 0; the "
                   r"chief's state differs in \d+ variable\(s\) .* and is at "
                   r"step 100\. Took the chief's state", workers.output(1))
  # Both trained steps 100 -> 160 on the same state.
  for i in (0, 1):
    assert "step 100 -> 160" in workers.output(i)
  assert artifacts.checkpoint_step(str(chief_dir)) == 160
  artifacts.assert_weights_close(artifacts.model_weights(str(chief_dir)),
                                 artifacts.model_weights(str(reference)),
                                 rtol=1e-5)


@pytest.mark.serial
def test_sigterm_with_a_stalled_peer_exits_within_the_grace(tmp_path,
                                                            data_dir):
  """Worker 1 stops taking part at step 40 (tests/stall_worker.py), alive
  and heartbeating: worker 0 waits in a collective with no end. SIGTERM to
  worker 0 ends it within --sigterm_grace_seconds, with one line, code
  143 and no new checkpoint; then the same for worker 1, which removes
  its scratch model_dir (no launcher owns its TMPDIR, as over SSH)."""
  model_dir, scratch = tmp_path / "run", tmp_path / "tmp"
  scratch.mkdir()
  workers = Workers(tmp_path, [model_dir, model_dir], [
      f"--data_dir={data_dir}", "--train_steps=1000000",
      "--sigterm_grace_seconds=5", "--checkpoint_every=0"],
      module="tests.stall_worker", env={"TMPDIR": str(scratch)})
  try:
    workers.wait_for(1, "stall_worker: worker 1 stops taking part")
    time.sleep(2)  # Worker 0 now waits in a collective.
    assert list(scratch.glob("tfdist-worker1-*"))  # Its model_dir.
    for i in (0, 1):
      started = time.monotonic()
      os.kill(workers.procs[i].pid, signal.SIGTERM)
      code = workers.procs[i].wait(timeout=60)
      waited = time.monotonic() - started
      assert code == 143, workers.output(i)[-2000:]
      assert 4.5 <= waited < 20, waited
      last = workers.output(i).strip().splitlines()[-1]
      assert last == (f"tfdist: error: worker:{i} got SIGTERM and could not "
                      "stop at an agreed step within 5s (a peer is gone or "
                      "stalled); exiting with code 143, without a new "
                      "checkpoint."), last
    assert not list(model_dir.glob("ckpt-*.index"))
    assert not list(scratch.glob("tfdist-worker1-*")), list(scratch.iterdir())
  finally:
    workers.kill()
