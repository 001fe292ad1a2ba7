"""The README's promises, run as written: the flag table is the options
table, and the "Train your own model" example runs from a directory
outside the repository."""

import os
import re
import subprocess
import sys

from conftest import ROOT

README = os.path.join(ROOT, "README.md")


def _readme():
  with open(README) as f:
    return f.read()


def _blocks(section, language):
  text = _readme().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
  return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def test_flag_table_is_the_options_table():
  table = subprocess.run([sys.executable, "-m", "tools.flags_table"],
                         cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
  assert table in _readme()


def test_train_your_own_model_runs_as_written(tmp_path):
  module, task, api = _blocks("Train your own model", "python")
  (commands,) = _blocks("Train your own model", "sh")
  (tmp_path / "mymodel.py").write_text(module)
  # `python` is the environment tfdist is installed in, as for a user.
  env = {**os.environ,
         "PATH": os.path.dirname(sys.executable) + os.pathsep +
                 os.environ["PATH"]}
  for line in commands.strip().splitlines():
    proc = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Finished at step 200/200" in proc.stdout
  (tmp_path / "api.py").write_text(task + api)
  proc = subprocess.run([sys.executable, "api.py"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  step, metrics = proc.stdout.strip().splitlines()[-1].split(" ", 1)
  assert step == "200" and "'mae'" in metrics and "'examples': 400" in metrics
