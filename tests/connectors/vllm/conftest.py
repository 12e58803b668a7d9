"""Fixtures of the vLLM tests."""

from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture
def short_dir():
    """A directory with a short path: a unix socket path must fit in 108 bytes."""
    directory = tempfile.mkdtemp(prefix="kvv-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)
