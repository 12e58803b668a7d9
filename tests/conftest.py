"""Shared fixtures and factories; the `gpu` marker skips without CUDA."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def promtool() -> str:
    """scripts/install-promtool, as CI runs it from a clean checkout. A failure fails the tests."""
    done = subprocess.run([str(REPO / "scripts" / "install-promtool")], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"scripts/install-promtool failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]
