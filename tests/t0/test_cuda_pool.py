"""The CUDA device pool: a dedicated allocation, zeroed, shared with another process through
its IPC handle. The GPU tests skip without CUDA; the error paths run everywhere."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtierd.errors import FailedPrecondition, InvalidArgument
from kvtierd.t0.cuda_pool import CudaDevicePool
from kvtierd.t0.factory import attach_device_pool, create_device_pool
from kvtierd.t0.pool_handle import PoolHandle
from tests.factories import check_copy_block_copies_exactly_one, fill_pattern, small_layout

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 4
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs CUDA (torch.cuda.is_available() is false)")

CHILD = textwrap.dedent("""
    import json, pickle, sys, torch
    from kvtierd.t0.factory import attach_device_pool
    handle = pickle.loads(sys.stdin.buffer.read())
    with attach_device_pool(handle) as pool:
        assert pool.device == torch.device("cuda", handle.device_index), pool.device
        sys.stdout.write(json.dumps(pool.tensor.float().flatten().tolist()))
        pool.block(1).fill_(-3.5)
        torch.cuda.synchronize()
""")


@pytest.fixture
def cuda_pool():
    with create_device_pool(small_layout(), NUM_BLOCKS, device="cuda:0", cuda_share="ipc") as pool:
        yield pool


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn"])
def test_cuda_pool_is_a_zeroed_dedicated_allocation(dtype):
    """Block-major shape in the layout dtype, zeros, on cuda:0, with a 64-byte IPC handle."""
    layout = small_layout(dtype=dtype)
    with create_device_pool(layout, NUM_BLOCKS, cuda_share="ipc") as pool:  # 'auto' picks CUDA where present
        assert isinstance(pool, CudaDevicePool)
        assert pool.device == torch.device("cuda", 0)
        assert pool.tensor.shape == (NUM_BLOCKS, *layout.block_shape)
        assert pool.tensor.dtype == layout.torch_dtype and pool.tensor.is_contiguous()
        assert pool.nbytes == NUM_BLOCKS * layout.bytes_per_block
        assert pool.handle.kind == "cuda_ipc" and len(pool.handle.ipc_handle) == 64
        assert torch.count_nonzero(pool.tensor.view(torch.uint8)) == 0
        assert pool.block(3).data_ptr() == pool.tensor.data_ptr() + 3 * layout.bytes_per_block


@pytest.mark.gpu
@requires_cuda
def test_second_process_maps_the_pool_through_the_ipc_handle(cuda_pool):
    """A spawned process opens the IPC handle, reads the pattern, and its write shows here."""
    before = fill_pattern(cuda_pool)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-P", "-c", CHILD], input=pickle.dumps(cuda_pool.handle),
                          env=env, cwd=REPO_ROOT, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout) == before.float().flatten().tolist()
    torch.cuda.synchronize()
    assert torch.all(cuda_pool.block(1) == -3.5)
    for block_id in (0, 2, 3):
        assert torch.equal(cuda_pool.block(block_id), before[block_id])


@pytest.mark.gpu
@requires_cuda
def test_cuda_copy_block_copies_exactly_one_block(cuda_pool):
    check_copy_block_copies_exactly_one(cuda_pool)
    before = cuda_pool.tensor.clone()
    with pytest.raises(InvalidArgument, match="block_id"):
        cuda_pool.copy_block(0, NUM_BLOCKS)
    assert torch.equal(cuda_pool.tensor[[0, 1, 3]], before[[0, 1, 3]])


@pytest.mark.gpu
@requires_cuda
def test_close_frees_the_allocation():
    """The pool is not torch's cache: closing it returns its bytes to the device at once."""
    layout = small_layout()
    num_blocks = (256 << 20) // layout.bytes_per_block  # 256 MiB
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info(0)
    pool = create_device_pool(layout, num_blocks, device="cuda")
    free_open, _ = torch.cuda.mem_get_info(0)
    assert free_before - free_open >= pool.nbytes
    pool.close()
    pool.close()
    free_after, _ = torch.cuda.mem_get_info(0)
    assert free_after - free_open >= pool.nbytes
    with pytest.raises(FailedPrecondition, match="closed"):
        pool.tensor


def test_missing_cupy_names_the_extra(monkeypatch):
    """Without CuPy the CUDA pool says how to get it instead of an ImportError deep inside."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(FailedPrecondition, match=r"kvtierd\[cuda\]"):
        CudaDevicePool.create(small_layout(), NUM_BLOCKS, device_index=0)


def test_attaching_a_cuda_handle_without_cuda_is_failed_precondition(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    layout = small_layout()
    handle = PoolHandle("cuda_ipc", layout, NUM_BLOCKS, NUM_BLOCKS * layout.bytes_per_block,
                        ipc_handle=bytes(64), device_index=0)
    with pytest.raises(FailedPrecondition, match="needs CUDA"):
        attach_device_pool(handle)


def test_a_segment_name_for_a_cuda_pool_is_invalid_argument(monkeypatch):
    """Names belong to shm segments; the check comes before any device memory is touched."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidArgument, match="shm pools only"):
        create_device_pool(small_layout(), NUM_BLOCKS, device="cuda", name="kvtierd-x")
