"""A disk that fills up during a checkpoint save: one clear line naming
the path, the previous checkpoint stays the latest and restores, nothing
partial is left, and after freeing space the same command resumes."""

import os
import shutil
import subprocess

import pytest

import artifacts
from conftest import run_cli


@pytest.fixture
def small_disk(tmp_path):
  if os.geteuid() != 0 or not shutil.which("mount"):
    pytest.skip("needs root to mount a small tmpfs")
  mount = tmp_path / "disk"
  mount.mkdir()
  subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs",
                  str(mount)], check=True)
  yield mount
  subprocess.run(["umount", str(mount)], check=False)


def test_full_disk_while_saving(small_disk, data_dir):
  model_dir = small_disk / "run"
  args = ["--export=false", "--checkpoint_every=100",
          f"--data_dir={data_dir}", f"--model_dir={model_dir}"]
  run_cli(*args, "--train_steps=100")
  # Leave less room than one checkpoint (about 1 MB for this MLP).
  free = shutil.disk_usage(small_disk).free
  filler = small_disk / "filler"
  filler.write_bytes(b"\0" * (free - 400_000))
  proc = run_cli(*args, "--train_steps=200", check=False)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr
  errors = [l for l in proc.stderr.splitlines() if "error:" in l]
  assert errors == [
      f"tfdist: error: could not write checkpoint {model_dir}/ckpt-200 "
      "(No space left on device [Op:SaveV2]); the previous checkpoint "
      f"{model_dir}/ckpt-100 is still the latest. Free space and run the "
      "same command to resume."], proc.stderr
  assert artifacts.checkpoint_step(str(model_dir)) == 100
  assert not [p for p in os.listdir(model_dir) if "ckpt-200" in p]
  filler.unlink()
  proc = run_cli(*args, "--train_steps=200")
  assert f"Resumed from {model_dir}/ckpt-100 at step 100." in proc.stderr
  assert artifacts.checkpoint_step(str(model_dir)) == 200
