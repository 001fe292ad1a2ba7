"""The README's and the manual's promises, run as written: the README is
a front page (at most 300 lines), every relative link resolves, the flag
table is the options table, and every block marked runnable runs from a
directory outside the repository, with the files the pages define."""

import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

README = os.path.join(ROOT, "README.md")
PAGES = [README, os.path.join(ROOT, "CHANGELOG.md"),
         *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
_FENCED = r"(?:\n```[a-z]*\n(.*?)```)"


def _read(path):
  with open(path) as f:
    return f.read()


def _files(text):
  """{name: content} of the blocks marked <!-- file: NAME -->."""
  return dict(re.findall(r"<!-- file: (\S+) -->" + _FENCED, text, re.S))


def _runnable(text):
  return re.findall(r"<!-- runnable -->" + _FENCED, text, re.S)


def _slug(heading):
  """GitHub's anchor for a heading."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text):
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_readme_is_a_front_page():
  assert len(_read(README).splitlines()) <= 300
  names = {os.path.basename(p) for p in PAGES}
  for page in ("user-tasks.md", "strategies.md", "launchers.md",
               "parameter-servers.md", "model-parallelism.md",
               "compression-and-scaling.md", "reliability.md",
               "benchmarks.md", "flags.md", "testing.md"):
    assert page in names, page


@pytest.mark.parametrize("page", PAGES, ids=os.path.basename)
def test_every_relative_link_resolves(page):
  text = re.sub(r"```.*?```", "", _read(page), flags=re.S)
  links = re.findall(r"\]\(([^)\s]+)\)", text)
  for link in links:
    if re.match(r"[a-z]+:", link):
      continue
    path, _, anchor = link.partition("#")
    target = os.path.normpath(os.path.join(os.path.dirname(page), path)) \
        if path else page
    assert os.path.exists(target), f"{page}: {link}"
    if anchor:
      assert anchor in _anchors(_read(target)), f"{page}: {link}"


def test_flag_table_is_the_options_table():
  table = subprocess.run([sys.executable, "-m", "tools.flags_table"],
                         cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
  assert table in _read(os.path.join(ROOT, "docs", "flags.md"))


def test_every_runnable_block_runs_as_written(tmp_path):
  """Each line of each runnable block, in a directory outside the
  repository holding the README's files and its own page's, with
  `python` the environment tfdist is installed in, as for a user."""
  env = {**os.environ,
         "PATH": os.path.dirname(sys.executable) + os.pathsep +
                 os.environ["PATH"]}
  readme_files = _files(_read(README))
  ran = []
  for page in PAGES:
    text = _read(page)
    blocks = _runnable(text)
    if not blocks:
      continue
    workdir = tmp_path / os.path.basename(page).replace(".md", "")
    workdir.mkdir()
    for name, content in {**readme_files, **_files(text)}.items():
      (workdir / name).write_text(content)
    for line in "\n".join(blocks).strip().splitlines():
      proc = subprocess.run(["bash", "-c", line], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=600)
      assert proc.returncode == 0, f"{page}: {line}\n{proc.stdout}" + (
          proc.stderr)
      if "tfdist.train" in line or "launch" in line:
        assert re.search(r"Finished at step (\d+)/\1", proc.stdout), line
      ran.append((os.path.basename(page), line, proc.stdout))
  pages = {page for page, _, _ in ran}
  assert {"README.md", "user-tasks.md"} <= pages
  # The Python API's example prints its step and eval metrics.
  (api,) = [out for _, line, out in ran if line == "python api.py"]
  step, metrics = api.strip().splitlines()[-1].split(" ", 1)
  assert step == "200" and "'mae'" in metrics and "'examples': 400" in (
      metrics)
