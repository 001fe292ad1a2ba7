"""Fuzzed input (hypothesis): TF_CONFIG JSON, cluster descriptions,
--placement specs and flag values. Every generated case must end in a
correct result or one user error (a TfdistError, or the parser's own
error), never another exception, within a time bound. 4 x 150 = 600
generated cases, plus real CLI runs of 6 cases of the same kind."""

import hashlib
import json
import subprocess
import sys

from absl import flags
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import pytest

from conftest import ROOT
from tfdist import cluster
from tfdist import options as options_lib
from tfdist import placement
from tfdist import train
from tfdist.errors import TfdistError
from tfdist.launch import description

CASES = settings(max_examples=150, deadline=2000, derandomize=True)

ROLES = st.sampled_from(["chief", "worker", "ps", "evaluator", "master",
                         "", "wörker"])
ADDRESSES = st.one_of(
    st.from_regex(r"\A[a-z0-9.]{1,12}:[0-9]{1,6}\Z"), st.text(max_size=12),
    st.integers(), st.none())
JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
              st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=6), inner,
                                            max_size=3)), max_leaves=8)


def _one_line(error):
  message = str(error)
  assert message and "\n" not in message.strip(), repr(message)


@CASES
@given(st.one_of(
    st.builds(lambda c, t: {"cluster": c, "task": t},
              st.dictionaries(ROLES, st.one_of(
                  st.lists(ADDRESSES, max_size=3),
                  st.dictionaries(st.text(max_size=3), ADDRESSES,
                                  max_size=3), ADDRESSES), max_size=4),
              st.one_of(st.fixed_dictionaries(
                  {"type": ROLES, "index": st.one_of(
                      st.integers(-2, 5), st.text(max_size=2))}),
                  JSONISH)),
    JSONISH, st.text(max_size=40)))
def test_tf_config(raw):
  text = raw if isinstance(raw, str) else json.dumps(raw)
  try:
    task = cluster.parse_tf_config(text)
  except TfdistError as e:
    _one_line(e)
    return
  assert task.task_type in cluster.ROLES
  assert task.address in [a for tasks in task.cluster.values()
                          for a in tasks.values()]


@CASES
@given(workers=st.integers(-3, 10**6), chief=st.booleans(),
       ps=st.integers(-3, 10**6), evaluator=st.booleans())
def test_cluster_description(workers, chief, ps, evaluator):
  try:
    desc = description.ClusterDescription(workers=workers, chief=chief,
                                          ps=ps, evaluator=evaluator)
  except ValueError as e:
    _one_line(e)
    return
  assert sum(desc.counts().values()) >= 1 and workers >= 0 and ps >= 0


@CASES
@given(spec=st.one_of(
    st.text(max_size=40),
    st.lists(st.tuples(st.sampled_from(["*", "dense_*", "logits", "x", ""]),
                       st.sampled_from(["/device:CPU:0", "/device:CPU:1",
                                        "", "=", "gpu"])), max_size=4).map(
        lambda rules: ";".join(f"{p}={d}" for p, d in rules))))
def test_placement_spec(spec):
  blocks = ["flatten", "dense_0", "dense_1", "logits"]
  try:
    plan = placement.plan_from_spec(placement.parse_spec(spec), blocks)
  except TfdistError as e:
    _one_line(e)
    return
  assert [b for stage in plan.stages for b in stage.blocks] == blocks


NAMES = [o.name for o in options_lib.OPTIONS if o.name != "flagfile"]
VALUES = st.one_of(
    st.integers(-2**70, 2**70).map(str), st.floats().map(str),
    st.sampled_from(["", "0", "-1", "nan", "inf", "1e400", "true", "mlp",
                     "x:y", "a,b", "1,2,3", "ünïcode", "\u202e", " "]),
    st.text(max_size=12))


def _config_from_argv(argv):
  values = flags.FlagValues()
  train.define_flags(values)
  values(["tfdist", *argv])
  return train.config_from_flags(values)


@CASES
@given(st.lists(st.tuples(st.sampled_from(NAMES), VALUES), max_size=4))
def test_flag_values(pairs):
  argv = ["--model_dir=/tmp/never-written"] + [f"--{n}={v}" for n, v in pairs]
  try:
    config = _config_from_argv(argv)
  except flags.Error as e:
    # The CLI prints the first line of the parser's message.
    assert str(e).splitlines()[0].strip()
    return
  except TfdistError as e:
    _one_line(e)
    return
  assert config.batch_size > 0 and config.train_steps > 0


# A sample of generated-style cases through the real CLI: one line, no
# traceback, model_dir untouched.
CLI_CASES = [
    ["--batch_size=99999999999999999999999"], ["--learning_rate=nan"],
    ["--strategy=ünïcode"], ["--profile_steps=5,a"], ["--placement=="],
    ["--lr_schedule=\u202e"],
]


def _digest(path):
  return hashlib.sha256(b"".join(
      p.name.encode() + p.read_bytes() for p in sorted(path.iterdir())
      if p.is_file())).hexdigest()


@pytest.mark.parametrize("argv", CLI_CASES, ids=range(len(CLI_CASES)))
def test_fuzzed_flags_through_the_cli(tmp_path, argv):
  model_dir = tmp_path / "kept"
  model_dir.mkdir()
  (model_dir / "marker").write_text("x")
  before = _digest(model_dir)
  proc = subprocess.run(
      [sys.executable, "-m", "tfdist.train", *argv,
       f"--model_dir={model_dir}", "--train_steps=2", "--export=false"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  if proc.returncode == 0:
    assert "Finished at step 2/2" in proc.stdout
    return
  assert "Traceback" not in proc.stderr
  errors = [l for l in proc.stderr.splitlines() if "error:" in l]
  assert len(errors) == 1 and errors[0].startswith("tfdist: error:"), (
      proc.stderr)
  assert _digest(model_dir) == before
