"""Mapping a device pool from a descriptor its creator passed: the same bytes, no name opened.

The CPU pool's descriptor is its /dev/shm segment's; a "cuda_fd" pool's is a cuMem allocation's
POSIX fd (gpu tests, skipped without CUDA)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

from kvtierd.errors import FailedPrecondition, InvalidArgument, NotFound
from kvtierd.t0.factory import attach_device_pool, create_device_pool, shareable_fd
from kvtierd.t0.pool_handle import PoolHandle
from tests.factories import small_layout

NUM_BLOCKS = 6

CHILD = """
import os, pickle, sys
import torch
from kvtierd.t0.factory import attach_device_pool
handle, fd = pickle.loads(sys.stdin.buffer.read())
with attach_device_pool(handle, fd) as pool:
    seen = float(pool.tensor[1].float().mean())
    pool.tensor[4].fill_(2.5)
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    print(seen)
"""


def run_child(handle: PoolHandle, fd: int) -> str:
    done = subprocess.run([sys.executable, "-P", "-c", CHILD], input=pickle.dumps((handle, fd)),
                          capture_output=True, timeout=120, pass_fds=[fd])
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip()


def test_a_pool_mapped_from_its_descriptor_shares_the_bytes_without_its_name():
    """The segment's name is gone (unlinked), yet the descriptor maps the very same memory."""
    with create_device_pool(small_layout(), NUM_BLOCKS, device="cpu") as pool:
        os.unlink(pool.path)  # by name there is nothing left to open
        with pytest.raises(NotFound):
            attach_device_pool(pool.handle)
        fd = os.dup(shareable_fd(pool))
        try:
            attached = attach_device_pool(pool.handle, fd)
        finally:
            os.close(fd)
        pool.tensor[2].fill_(1.5)
        assert bool((attached.tensor[2] == 1.5).all())
        attached.tensor[3].fill_(-1.0)
        assert bool((pool.tensor[3] == -1.0).all())
        attached.close()
        assert not pool.closed and bool((pool.tensor[3] == -1.0).all())


def test_another_process_maps_the_pool_from_a_passed_descriptor():
    """A child given only the descriptor reads the creator's bytes, and its write shows here."""
    with create_device_pool(small_layout(), NUM_BLOCKS, device="cpu") as pool:
        pool.tensor[1].fill_(0.75)
        assert run_child(pool.handle, shareable_fd(pool)) == "0.75"
        assert bool((pool.tensor[4] == 2.5).all()) and float(pool.tensor[5].abs().sum()) == 0


def test_a_descriptor_of_another_size_is_refused():
    """A descriptor that is not this pool's (wrong size) is FailedPrecondition, never a short map."""
    layout = small_layout()
    with create_device_pool(layout, NUM_BLOCKS, device="cpu") as pool, \
            create_device_pool(layout, NUM_BLOCKS + 1, device="cpu") as other:
        with pytest.raises(FailedPrecondition, match="holds"):
            attach_device_pool(pool.handle, shareable_fd(other))


def test_only_the_creator_holds_the_descriptor():
    with create_device_pool(small_layout(), NUM_BLOCKS, device="cpu") as pool:
        attached = attach_device_pool(pool.handle)
        with pytest.raises(InvalidArgument, match="creator"):
            shareable_fd(attached)
        attached.close()
    with pytest.raises(InvalidArgument, match="creator"):
        shareable_fd(pool)  # closed: the descriptor is closed with it


def test_a_cuda_fd_handle_without_its_descriptor_is_invalid_argument():
    layout = small_layout()
    handle = PoolHandle("cuda_fd", layout, NUM_BLOCKS, NUM_BLOCKS * layout.bytes_per_block, device_index=0)
    with pytest.raises(InvalidArgument, match="descriptor"):
        attach_device_pool(handle)


@pytest.mark.gpu
def test_a_cuda_fd_pool_is_mapped_by_another_process_from_its_posix_fd():
    """cuMemCreate(POSIX fd) → export → a child imports and maps it: same bytes both ways."""
    with create_device_pool(small_layout(), NUM_BLOCKS, device="cuda:0", cuda_share="fd") as pool:
        assert pool.handle.kind == "cuda_fd" and pool.device == torch.device("cuda", 0)
        assert torch.count_nonzero(pool.tensor.view(torch.uint8)) == 0
        pool.tensor[1].fill_(0.75)
        torch.cuda.synchronize()
        assert run_child(pool.handle, shareable_fd(pool)) == "0.75"
        assert bool((pool.tensor[4] == 2.5).all())


@pytest.mark.gpu
def test_closing_a_cuda_fd_pool_frees_its_memory():
    layout = small_layout()
    num_blocks = (256 << 20) // layout.bytes_per_block
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info(0)
    pool = create_device_pool(layout, num_blocks, device="cuda", cuda_share="fd")
    free_open, _ = torch.cuda.mem_get_info(0)
    assert free_before - free_open >= pool.nbytes
    pool.close()
    free_after, _ = torch.cuda.mem_get_info(0)
    assert free_after - free_open >= pool.nbytes
