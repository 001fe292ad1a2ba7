"""One source for every option; one cluster description for every
launcher; a clean install. A run's hparams and the profile in
TensorBoard are checked on tests/test_run_outputs.py's run."""

import dataclasses
import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT
from tfdist import config as config_lib
from tfdist import options as options_lib
from tfdist.launch import k8s
from tfdist.launch import local
from tfdist.launch import ssh

NAMES = [o.name for o in options_lib.OPTIONS]


def test_config_fields_are_exactly_the_options():
  fields = [f.name for f in dataclasses.fields(config_lib.Config)]
  assert fields == NAMES
  config = config_lib.Config(model_dir="/tmp/x")
  for option in options_lib.OPTIONS:
    assert getattr(config, option.name) == (
        option.default if option.name != "model_dir" else "/tmp/x")
  assert set(config.section("parameter_server")) == {
      "ps_shard_min_bytes", "ps_max_shards", "sidecar_timeout"}


def test_helpfull_lists_every_option_grouped_with_its_default():
  proc = subprocess.run([sys.executable, "-m", "tfdist.train", "--helpfull"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  text = proc.stdout
  for option in options_lib.OPTIONS:
    assert f"--{option.name}" in text or f"--[no]{option.name}" in text, (
        option.name)
  for section in options_lib.SECTIONS:
    assert f"tfdist {section}:" in text, section
  assert "(default: '64')" in text  # --batch_size, with its default.


def test_help_lists_the_main_flags_of_each_section():
  """absl's short --help (exit 1, as absl has it) shows the key flags and
  how to use the command; --helpfull every flag."""
  for command in ([sys.executable, "-m", "tfdist.train"],
                  [os.path.join(os.path.dirname(sys.executable),
                                "tfdist-train")]):
    proc = subprocess.run([*command, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    text = proc.stdout
    assert "python -m tfdist.train --model_dir=DIR" in text, text
    for name in options_lib.KEY_OPTIONS:
      assert f"--{name}:" in text or f"--[no]{name}:" in text, name
    assert "--powersgd_rank" not in text  # Not a main flag.
  sections = {o.section for o in options_lib.OPTIONS
              if o.name in options_lib.KEY_OPTIONS}
  assert sections == set(options_lib.SECTIONS)


def test_bad_option_values_name_the_option():
  for kwargs, expected in [
      ({"batch_size": 0}, "Received: batch_size=0"),
      ({"batch_size": "64"}, "batch_size takes an integer"),
      ({"learning_rate": -1.0}, "learning_rate must be >= 0"),
      ({"lr_schedule": "warp"}, "Unrecognized lr_schedule: 'warp'"),
      ({"clip_norm": 1.0, "mixed_precision": "mixed_float16"},
       "clip_norm would clip loss-scaled"),
      ({"cache": "none"}, r"a path prefix \(with a / in it.*cache='none'"),
      ({"cache": "/tmp/dir/"}, "cache='/tmp/dir/'"),
  ]:
    with pytest.raises(Exception, match=expected):
      config_lib.Config(model_dir="/tmp/x", **kwargs)


@pytest.mark.parametrize("parse,extra", [
    (local.parse_args, []),
    (ssh.parse_args, ["--hosts=a,b,c,d"]),
    (k8s.parse_args, ["--name=job", "--image=img"]),
])
def test_every_launcher_takes_the_same_cluster_description(parse, extra):
  args = parse(["--chief", "--workers=1", "--ps=1", "--evaluator", *extra,
                "--", "--train_steps=5"])
  assert args.cluster.counts() == {"chief": 1, "worker": 1, "ps": 1,
                                   "evaluator": 1}
  assert args.train_args == ["--train_steps=5"]


def test_wheel_installs_beside_a_foreign_tools_package(tmp_path):
  """No generic top-level package in the wheel; an existing `tools`
  package and tfdist both keep working side by side."""
  wheels, source = tmp_path / "wheels", tmp_path / "source"
  # Built from the tracked files alone: a build/ left in the checkout by
  # an earlier wheel would slip its stale packages into this one.
  tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
  for name in filter(None, tracked):
    os.makedirs(os.path.dirname(source / name), exist_ok=True)
    shutil.copy2(os.path.join(ROOT, name), source / name)
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                  "--no-build-isolation", "-w", str(wheels), str(source)],
                 check=True, capture_output=True, timeout=300)
  wheel = glob.glob(str(wheels / "tfdist-*.whl"))[0]
  tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
  assert {t for t in tops if not t.startswith("tfdist")} == set(), tops
  target, theirs = tmp_path / "site", tmp_path / "theirs"
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                  "--target", str(target), wheel], check=True,
                 capture_output=True, timeout=300)
  (theirs / "tools").mkdir(parents=True)
  (theirs / "tools" / "__init__.py").write_text("OWNER = 'someone else'\n")
  env = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{theirs}"}
  # Every package of the source tree's tfdist/ (a new one must be listed
  # in setup.cfg, or the wheel ships without it).
  subpackages = sorted(
      f"tfdist.{name}" for name in os.listdir(os.path.join(ROOT, "tfdist"))
      if os.path.exists(os.path.join(ROOT, "tfdist", name, "__init__.py")))
  assert "tfdist.data" in subpackages
  # Checked in the wheel itself: the editable install of the test's own
  # environment would import a missing subpackage from the checkout.
  names = set(zipfile.ZipFile(wheel).namelist())
  assert {p for p in subpackages
          if p.replace(".", "/") + "/__init__.py" not in names} == set()
  check = ("import tools, tfdist, tfdist.models, tfdist.launch.local, "
           f"tfdist.tools.tf_config, {', '.join(subpackages)}; "
           "assert tools.OWNER == 'someone else'; "
           "assert tfdist.__file__.startswith(%r); "
           "print(tfdist.models.names())" % str(target))
  proc = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "mlp" in proc.stdout
  # The console scripts are there and answer.
  for script, flag, expected in (
      ("tfdist-train", "--helpfull", "--model_dir"),
      ("tfdist-launch", "--help", "--max_restarts")):
    proc = subprocess.run([str(target / "bin" / script), flag],
                          cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert expected in proc.stdout, proc.stdout + proc.stderr
