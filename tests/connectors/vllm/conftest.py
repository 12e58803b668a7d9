"""Fixtures of the vLLM tests."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args


@pytest.fixture
def short_dir():
    """A directory with a short path: a unix socket path must fit in 108 bytes."""
    directory = tempfile.mkdtemp(prefix="kvv-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def daemon(tmp_path):
    """A small `kvtierd serve` of this test's own (some modules share one per module instead)."""
    with DaemonProcess(small_daemon_args(str(tmp_path))) as process:
        yield process
