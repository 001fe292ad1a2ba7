"""Bad input: one clear line on stderr, non-zero exit, no traceback, and
nothing in model_dir lost."""

import hashlib
import os

import pytest

from conftest import run_cli


def _tree_digest(path):
  digest = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(path)):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      digest.update(full.encode())
      with open(full, "rb") as f:
        digest.update(f.read())
  return digest.hexdigest()


def _assert_one_line_error(proc, expected):
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr
  errors = [l for l in proc.stderr.splitlines() if "error:" in l]
  assert len(errors) == 1, proc.stderr
  assert expected in errors[0], errors[0]


CASES = {
    "indivisible_batch": (
        ["--strategy=mirrored", "--num_cpu_devices=4", "--batch_size=30"],
        "Received: batch_size=30 for 4 replicas"),
    "unknown_strategy": (["--strategy=bogus"], "--strategy=bogus"),
    "unknown_model": (["--model=bogus"], "Unrecognized model: 'bogus'"),
    "unknown_dataset": (["--dataset=bogus"],
                        "Unrecognized dataset: 'bogus'. Valid: digits"),
    "zero_cpu_devices": (["--num_cpu_devices=0"],
                         "Received: num_cpu_devices=0"),
    "too_many_replicas": (
        ["--strategy=mirrored", "--num_cpu_devices=2", "--num_replicas=4"],
        "num_replicas=4 but only 2 devices exist"),
    "zero_train_steps": (["--train_steps=0"], "Received: train_steps=0"),
    "missing_flagfile": (["--flagfile=configs/does_not_exist.cfg"],
                         "Unable to open flagfile"),
    "no_tpu": (["--strategy=tpu", "--tpu=local"], "no TPU found at 'local'"),
    "ps_without_cluster": (["--strategy=parameter_server"],
                           "needs a TF_CONFIG with chief, worker and ps"),
    "pipeline_under_mirrored": (
        ["--strategy=mirrored", "--num_cpu_devices=2",
         "--model_parallel=pipeline"],
        "needs a strategy whose replica can span local devices"),
    "more_stages_than_blocks": (
        ["--model_parallel=pipeline", "--num_cpu_devices=4",
         "--num_stages=5"], "num_stages=5 is more than the model's 4 blocks"),
    "stages_without_devices": (
        ["--model_parallel=pipeline", "--num_stages=2"],
        "num_stages=2 needs 2 devices; only 1 exist"),
    "tensor_parallel_width": (
        ["--model_parallel=tensor", "--num_cpu_devices=3",
         "--tensor_parallel=3"],
        "tensor_parallel=3 must divide the tp_mlp_column output width"),
    "microbatches_divide": (
        ["--model_parallel=pipeline", "--num_cpu_devices=2",
         "--num_microbatches=5"],
        "Received: num_microbatches=5 for a per-replica batch of 64"),
    "placement_missing_device": (
        ["--model_parallel=pipeline", "--num_cpu_devices=2",
         "--placement=flatten=/device:CPU:0;*=/device:CPU:7"],
        "placement names device '/device:CPU:7', which does not exist"),
}


# Refused from the flags and TF_CONFIG alone, before TF loads (0.2 s,
# not 6-10 s): these run with a `tensorflow` that fails to import, and
# model_dir is not even made.
BEFORE_TENSORFLOW = ("unknown_strategy", "unknown_model", "zero_train_steps",
                     "missing_flagfile", "ps_without_cluster")


@pytest.fixture(scope="module")
def no_tensorflow(tmp_path_factory):
  """PYTHONPATH for a process in which `import tensorflow` fails."""
  path = tmp_path_factory.mktemp("no_tensorflow")
  (path / "tensorflow").mkdir()
  (path / "tensorflow" / "__init__.py").write_text(
      'raise ImportError("tensorflow was imported")\n')
  return {"PYTHONPATH": os.pathsep.join(
      [str(path), *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_flag_gives_one_line(name, tmp_path, data_dir, no_tensorflow):
  args, expected = CASES[name]
  model_dir = tmp_path / "run"
  before = name in BEFORE_TENSORFLOW
  proc = run_cli(f"--model_dir={model_dir}", f"--data_dir={data_dir}",
                 "--train_steps=5", *args, check=False,
                 env=no_tensorflow if before else None)
  _assert_one_line_error(proc, expected)
  if before:
    assert not model_dir.exists()


def test_unwritable_model_dir(tmp_path, data_dir):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  proc = run_cli(f"--model_dir={blocker / 'run'}", f"--data_dir={data_dir}",
                 check=False)
  _assert_one_line_error(proc, "is not writable")
  assert blocker.read_text() == "not a directory"


def test_incompatible_checkpoint_is_kept(tmp_path, data_dir):
  model_dir = str(tmp_path / "run")
  run_cli(f"--model_dir={model_dir}", f"--data_dir={data_dir}",
          "--train_steps=10", "--log_every=10", "--steps_per_loop=10")
  before = _tree_digest(model_dir)
  proc = run_cli(f"--model_dir={model_dir}", f"--data_dir={data_dir}",
                 "--model=cnn", "--train_steps=20", check=False)
  _assert_one_line_error(proc, "holds checkpoints of model 'mlp', not 'cnn'")
  assert _tree_digest(model_dir) == before


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, data_dir):
  model_dir = str(tmp_path / "run")
  common = [f"--model_dir={model_dir}", f"--data_dir={data_dir}",
            "--optimizer=sgd", "--steps_per_loop=5", "--log_every=5",
            "--checkpoint_every=5"]
  run_cli(*common, "--train_steps=5")
  assert os.path.exists(os.path.join(model_dir, "ckpt-5.index"))
  export = os.path.join(model_dir, "export")
  assert os.path.exists(os.path.join(export, "saved_model.pb"))
  export_before = _tree_digest(export)
  proc = run_cli(*common, "--train_steps=30", "--learning_rate=1e6",
                 check=False)
  _assert_one_line_error(proc, "loss became nan at step")
  assert proc.returncode == 3
  error = proc.stderr.strip().splitlines()[-1]
  step = int(error.split("at step ")[1].split(";")[0])
  assert 5 < step <= 30
  assert "ckpt-5" in error
  ckpts = sorted(f for f in os.listdir(model_dir) if f.endswith(".index"))
  assert ckpts == ["ckpt-5.index"]
  # No export from the NaN weights, and nothing half-written beside it
  # (a staging, previous or partial path is a dot-file of model_dir).
  assert _tree_digest(export) == export_before
  assert [f for f in os.listdir(model_dir) if f.startswith(".")] == []
