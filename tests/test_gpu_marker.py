"""The `gpu` marker: a missing CuPy on a machine with CUDA is a failure, not a skip."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

# pytest in a child whose torch reports CUDA and whose CuPy cannot be imported.
CUDA_WITHOUT_CUPY = ("import sys, torch; torch.cuda.is_available = lambda: True; sys.modules['cupy'] = None; "
                     "import pytest; sys.exit(pytest.main(sys.argv[1:]))")
NODE = "tests/movers/test_fp8_codec.py::test_cuda_dequantize_from_unpacked_slot_views"


def test_a_gpu_test_fails_where_cuda_is_present_but_cupy_is_not():
    """The cuda extra left out on a GPU machine must not pass as skipped gpu tests."""
    env = {k: v for k, v in os.environ.items() if k != "KVTIERD_REQUIRE_GPU"}
    done = subprocess.run([sys.executable, "-c", CUDA_WITHOUT_CUPY, "-q", "-p", "no:cacheprovider", "-m", "gpu", NODE],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "1 error" in done.stdout, done.stdout + done.stderr
    assert "CUDA is present and CuPy does not import" in done.stdout, done.stdout
