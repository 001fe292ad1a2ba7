"""tools.netlab, short form: 2 workers in their own namespaces over a
shaped 1 Gbit/s bridge; float32 bytes match the ring bound, PowerSGD's
match its element count, the probe and the rounds are recorded, and the
lab leaves nothing behind, even when interrupted. The lab tests need root,
ip and tc."""

import ipaddress
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from tools import netlab
from tfdist import compression

MLP_WIDE = [(64, 2048), (2048,), (2048, 2048), (2048,), (2048, 10), (10,)]

_needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"),
                                 reason="needs root, ip and tc")


def lab_test(test):
  # Times traffic on shaped links: run alone (.ci/run).
  return pytest.mark.serial(_needs_root(test))


def _lab_namespaces(pid=""):
  listed = subprocess.run(["ip", "netns", "list"], capture_output=True,
                          text=True, check=True).stdout
  return [line.split()[0] for line in listed.splitlines()
          if line.startswith(f"tfdist-{pid}") and "-lab-" in line]


def _netlab(*args):
  return [sys.executable, "-m", "tools.netlab", *args]


@lab_test
def test_lab_addresses_and_routes_stay_in_the_benchmark_range():
  with netlab.Lab(tasks=4, rate_bits=1e9) as lab:
    for k in range(4):
      assert ipaddress.ip_address(lab.address(k)) in netlab.BENCHMARK_RANGE
      routes = subprocess.run(
          ["ip", "-n", lab.task_ns[k], "-j", "route", "show"],
          capture_output=True, text=True, check=True).stdout
      # Only the lab subnet: no default route, nowhere else to send to.
      assert [r["dst"] for r in json.loads(routes)] == ["198.18.0.0/24"]
      qdiscs = subprocess.run(
          ["ip", "netns", "exec", lab.task_ns[k], "tc", "qdisc", "show",
           "dev", f"v{k}"], capture_output=True, text=True,
          check=True).stdout
      assert "tbf" in qdiscs and "rate 1Gbit" in qdiscs
    assert len(_lab_namespaces(os.getpid())) == 5
  assert not _lab_namespaces(os.getpid())


@lab_test
def test_float32_and_powersgd_bytes_per_step(tmp_path, data_dir):
  out = tmp_path / "lab.json"
  before = _lab_namespaces()
  proc = subprocess.run(
      _netlab("--workers=2", "--links=1gbit", "--configs=float32,powersgd:4",
              "--model=mlp_wide", "--steps=24", "--log_every=8",
              "--rounds=1", "--probe_sizes=65536",
              f"--data_dir={data_dir}", f"--json_out={out}"),
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "| 1gbit | 2 | powersgd:4 | 0 |" in proc.stdout
  assert "latency is queueing only" in proc.stdout
  lab = json.loads(out.read_text())
  float32, powersgd = lab["results"]
  # One round (how rounds combine is tested on its own below).
  for result in (float32, powersgd):
    assert result["seconds_rounds"] == [result["seconds_per_step"]]
  # One all-reduce time per size, and the one-core compute time: what
  # tools.scaling fits.
  assert [(p["link"], p["workers"], p["bytes"]) for p in lab["probe"]] == [
      ("1gbit", 2, 65536)]
  assert all(p["seconds"] > 0 for p in lab["probe"])
  assert [c["batch"] for c in lab["compute"]] == [32]
  elements = sum(math.prod(shape) for shape in MLP_WIDE)
  # Ring all-reduce over 2 workers: each sends and receives the gradient
  # once per step. Measured on the links, with headers and the per-loop
  # metric sums: within 1%.
  for worker in range(2):
    for direction in ("sent_per_step", "received_per_step"):
      assert float32[direction][worker] == pytest.approx(4 * elements,
                                                         rel=0.01)
  sent, plain = compression.wire_elements(MLP_WIDE, rank=4)
  assert plain / sent >= 50
  ratio = sum(powersgd["sent_per_step"]) / sum(float32["sent_per_step"])
  assert ratio == pytest.approx(sent / plain, rel=0.02)
  assert _lab_namespaces() == before


@lab_test
def test_interrupted_lab_removes_everything(tmp_path, data_dir):
  proc = subprocess.Popen(
      _netlab("--workers=2", "--links=100mbit", "--configs=float32",
              "--model=mlp", "--steps=3000", "--log_every=10",
              f"--data_dir={data_dir}"),
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 120
  while len(_lab_namespaces(proc.pid)) < 3:
    assert proc.poll() is None and time.monotonic() < deadline
    time.sleep(0.2)
  time.sleep(3)  # The job's processes are starting in the namespaces.
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, err
  assert "interrupted; every lab namespace was removed" in err
  assert "Traceback" not in err
  assert not _lab_namespaces(proc.pid)
  leftover = subprocess.run(["pgrep", "-f", f"tfdist-{proc.pid}-lab"],
                            capture_output=True, text=True).stdout
  assert not leftover


@lab_test
def test_bad_flags_are_one_line():
  proc = subprocess.run(_netlab("--links=fast"), cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "tools.netlab: error: a link rate is a number and kbit, mbit or gbit. "
      "Received: 'fast'"]


def _result(seconds, config="float32", sent=(10.0, 20.0), accuracy=0.9):
  return netlab.Result(link="1gbit", workers=2, config=config,
                       bytes_per_pack=0, seconds_per_step=seconds,
                       sent_per_step=list(sent), received_per_step=[5.0, 5.0],
                       accuracy=accuracy, steps_measured=10)


def test_rounds_combine_to_the_median_and_keep_the_spread():
  combined = netlab.combine([_result(0.30, sent=(10.0, 20.0)),
                             _result(0.50, sent=(30.0, 40.0), accuracy=0.8),
                             _result(0.31, accuracy=0.7)])
  assert combined.seconds_per_step == 0.31
  assert combined.seconds_rounds == [0.30, 0.50, 0.31]
  assert combined.sent_per_step == pytest.approx([50 / 3, 80 / 3])
  assert combined.accuracy == 0.8
  with pytest.raises(ValueError, match="one configuration"):
    netlab.combine([_result(0.3), _result(0.3, config="float16")])


def test_tasks_are_pinned_to_cores_in_their_namespace():
  lab = netlab.Lab(tasks=3, rate_bits=1e9, cores=2)
  assert lab.wrap(2, ["python", "-m", "x"]) == [
      "ip", "netns", "exec", lab.task_ns[2], "taskset", "-c", "0", "python",
      "-m", "x"]
  unpinned = netlab.Lab(tasks=3, rate_bits=1e9)
  assert unpinned.wrap(1, ["x"]) == ["ip", "netns", "exec",
                                     unpinned.task_ns[1], "x"]
  with pytest.raises(ValueError, match="Received: cores=0"):
    netlab.Lab(tasks=2, rate_bits=1e9, cores=0)


def test_lab_configs_name_their_module_and_flags():
  assert netlab.parse_config("float16") == (
      "tfdist.train", ["--allreduce_dtype=float16"])
  assert netlab.parse_config("float32/serial") == (
      "tfdist.train", ["--allreduce_dtype=float32", "--nooverlap_allreduce"])
  assert netlab.parse_config("powersgd:2") == (
      "tfdist.train", ["--allreduce_compression=powersgd",
                       "--powersgd_rank=2"])
  module, flags = netlab.parse_config("raw")
  assert module.endswith(".raw_mwms") and flags == []
  assert netlab.parse_config("alone") == ("alone", [])
  for bad in ("float32/fast", "powersgd:0", "int8"):
    with pytest.raises(ValueError, match=f"Received: '{bad}'"):
      netlab.parse_config(bad)


def test_speedups_are_taken_round_by_round():
  base = netlab.combine([_result(0.30), _result(0.60), _result(0.33)])
  other = netlab.combine([_result(0.20, config="raw"),
                          _result(0.30, config="raw"),
                          _result(0.30, config="raw")])
  assert netlab.speedups(other, base) == pytest.approx([1.5, 2.0, 1.1])
  text = netlab.table([base, other])
  assert "| raw | 0 | 0.300 |" in text
  assert "1.50x [1.10-2.00]" in text
