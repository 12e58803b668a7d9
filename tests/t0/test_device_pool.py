"""The device pool without CUDA: block-major geometry, COW copies, the shm segment's lifetime
and mode, and a second process that maps the pool by its handle."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import pickle
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtierd.errors import FailedPrecondition, InvalidArgument, NotFound
from kvtierd.t0.factory import attach_device_pool, create_device_pool
from kvtierd.t0.pool_handle import PoolHandle
from kvtierd.t0.shm_pool import ShmDevicePool
from tests.factories import check_copy_block_copies_exactly_one, fill_pattern, small_layout

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 4
BAD_BLOCK_IDS = [-1, NUM_BLOCKS, 10**9, 1.0, True, "1", None]


@pytest.fixture
def pool():
    with create_device_pool(small_layout(), NUM_BLOCKS, device="shm") as pool:
        yield pool


def test_pool_is_block_major_with_layout_dtype_and_nbytes(pool):
    """Shape [num_blocks, layers, 2, block_size, heads, dim], fp16, nbytes = blocks × block bytes."""
    layout = small_layout()
    assert pool.tensor.shape == (NUM_BLOCKS, 2, 2, 4, 2, 8)
    assert pool.tensor.dtype == torch.float16
    assert pool.nbytes == NUM_BLOCKS * layout.bytes_per_block == NUM_BLOCKS * 512
    assert pool.tensor.numel() * pool.tensor.element_size() == pool.nbytes
    assert pool.device == torch.device("cpu")
    assert pool.handle == PoolHandle("shm", layout, NUM_BLOCKS, pool.nbytes, name=pool.handle.name)
    assert torch.count_nonzero(pool.tensor) == 0  # a new segment reads as zeros


def test_each_block_is_one_contiguous_span_at_its_offset(pool):
    """Block i is contiguous and starts i × bytes_per_block after block 0."""
    base = pool.tensor.data_ptr()
    for block_id in range(NUM_BLOCKS):
        block = pool.block(block_id)
        assert block.shape == small_layout().block_shape
        assert block.is_contiguous()
        assert block.data_ptr() == base + block_id * small_layout().bytes_per_block


def test_layer_kv_views_alias_the_pool(pool):
    """Writing K or V of one layer through layer_kv shows in pool[:, layer, 0/1] and nowhere else."""
    keys, values = pool.layer_kv(1)
    assert keys.shape == values.shape == (NUM_BLOCKS, 4, 2, 8)
    assert keys.stride(0) == small_layout().bytes_per_block // 2  # a block stride, in elements
    keys[2].fill_(7)
    values[3].fill_(-2)
    assert torch.all(pool.tensor[2, 1, 0] == 7)
    assert torch.all(pool.tensor[3, 1, 1] == -2)
    assert torch.count_nonzero(pool.tensor) == 2 * 4 * 2 * 8
    with pytest.raises(InvalidArgument, match="layer"):
        pool.layer_kv(2)


def test_copy_block_copies_exactly_one_block(pool):
    """copy_block(0, 2): block 2 becomes block 0, every other block keeps its bytes."""
    check_copy_block_copies_exactly_one(pool)
    before = pool.tensor.clone()
    pool.copy_block(3, 3)
    assert torch.equal(pool.tensor[3], before[3])


@pytest.mark.parametrize("bad_id", BAD_BLOCK_IDS)
def test_bad_block_id_raises_and_changes_nothing(pool, bad_id):
    """An out-of-range or non-integer id, as source or destination, is InvalidArgument; no byte moves."""
    before = fill_pattern(pool)
    with pytest.raises(InvalidArgument, match="block_id"):
        pool.copy_block(bad_id, 1)
    with pytest.raises(InvalidArgument, match="block_id"):
        pool.copy_block(1, bad_id)
    with pytest.raises(InvalidArgument, match="block_id"):
        pool.block(bad_id)
    assert torch.equal(pool.tensor, before)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277], ids=lambda umask: f"umask{umask:03o}")
def test_segment_mode_is_exactly_0600_and_gone_after_close(umask):
    """Whatever the umask, the segment is 0600; close() unlinks it; a second close() is a no-op."""
    old_umask = os.umask(umask)
    try:
        pool = create_device_pool(small_layout(), NUM_BLOCKS, device="shm")
    finally:
        os.umask(old_umask)
    path = Path("/dev/shm") / pool.handle.name
    info = path.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size == pool.nbytes
    assert pool.handle.name.startswith(f"kvtierd-pool-{os.getpid()}-")
    pool.close()
    assert not path.exists()
    pool.close()
    assert pool.closed
    with pytest.raises(FailedPrecondition, match="closed"):
        pool.tensor


def test_context_exit_and_garbage_collection_unlink_the_segment():
    """The creator unlinks at context exit and, if never closed, when collected."""
    with create_device_pool(small_layout(), 1, device="shm") as pool:
        path = Path("/dev/shm") / pool.handle.name
        assert path.exists()
    assert not path.exists()
    pool = create_device_pool(small_layout(), 1, device="shm")
    path = Path("/dev/shm") / pool.handle.name
    del pool
    gc.collect()
    assert not path.exists()


def test_attacher_close_does_not_unlink(pool):
    """An attached pool shares the bytes; closing it leaves the creator's segment in place."""
    attached = attach_device_pool(pool.handle)
    attached.block(1).fill_(5)
    assert torch.all(pool.block(1) == 5)
    attached.close()
    attached.close()
    assert (Path("/dev/shm") / pool.handle.name).exists()
    pool.block(2).fill_(3)  # the creator's mapping still works
    assert torch.all(attach_device_pool(pool.handle).block(2) == 3)


CHILD = textwrap.dedent("""
    import json, pickle, sys, torch
    from kvtierd.t0.factory import attach_device_pool
    handle = pickle.loads(sys.stdin.buffer.read())
    with attach_device_pool(handle) as pool:
        sys.stdout.write(json.dumps(pool.tensor.float().flatten().tolist()))
        pool.block(1).fill_(-3.5)
""")


def run_child(handle: PoolHandle, code: str = CHILD) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-P", "-c", code], input=pickle.dumps(handle), env=env,
                          cwd=REPO_ROOT, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


def test_second_process_reads_and_writes_through_the_handle(pool):
    """Another process maps the segment by name, sees the pattern, and its write shows here."""
    before = fill_pattern(pool)
    seen = json.loads(run_child(pool.handle))
    assert seen == before.float().flatten().tolist()
    assert torch.all(pool.block(1) == -3.5)
    for block_id in (0, 2, 3):
        assert torch.equal(pool.block(block_id), before[block_id])
    assert (Path("/dev/shm") / pool.handle.name).exists()  # the attacher did not unlink


def test_attach_missing_segment_is_not_found(pool):
    handle = dataclasses.replace(pool.handle, name="kvtierd-test-no-such-segment")
    with pytest.raises(NotFound, match="does not exist"):
        attach_device_pool(handle)
    assert not Path("/dev/shm/kvtierd-test-no-such-segment").exists()  # and nothing was created


def test_attach_with_wrong_size_is_failed_precondition(pool):
    """A handle that promises another geometry than the segment holds is refused."""
    handle = dataclasses.replace(pool.handle, num_blocks=NUM_BLOCKS + 1,
                                 nbytes=pool.nbytes + small_layout().bytes_per_block)
    with pytest.raises(FailedPrecondition, match="bytes"):
        attach_device_pool(handle)


def test_existing_name_on_create_is_failed_precondition(pool):
    """Creating over a live segment fails and leaves that segment and its bytes alone."""
    before = fill_pattern(pool)
    with pytest.raises(FailedPrecondition, match="already exists"):
        create_device_pool(small_layout(), NUM_BLOCKS, device="shm", name=pool.handle.name)
    assert (Path("/dev/shm") / pool.handle.name).exists()
    assert torch.equal(attach_device_pool(pool.handle).tensor, before)


def test_user_given_name_is_used_and_validated():
    name = f"kvtierd-test-{os.getpid()}"
    with create_device_pool(small_layout(), 1, device="cpu", name=name) as pool:
        assert pool.handle.name == name and (Path("/dev/shm") / name).exists()
    for bad_name in ["a/b", "", "..", ".hidden", "x" * 201, "sp ace"]:
        with pytest.raises(InvalidArgument, match="name"):
            create_device_pool(small_layout(), 1, device="shm", name=bad_name)
    assert not list(Path("/dev/shm").glob("x" * 201))


@pytest.mark.parametrize("num_blocks", [0, -1, 2.0, True])
def test_bad_num_blocks_is_invalid_argument(num_blocks):
    with pytest.raises(InvalidArgument, match="num_blocks"):
        create_device_pool(small_layout(), num_blocks, device="shm")


def test_factory_picks_shm_without_cuda_and_refuses_cuda(monkeypatch):
    """'auto' means shm where torch sees no CUDA; asking for CUDA there is InvalidArgument."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with create_device_pool(small_layout(), 2) as pool:
        assert isinstance(pool, ShmDevicePool)
        assert pool.handle.kind == "shm" and pool.device.type == "cpu"
    for device in ["cuda", "cuda:0", "cuda:1"]:
        with pytest.raises(InvalidArgument, match="CUDA is not available"):
            create_device_pool(small_layout(), 2, device=device)
    for device in ["tpu", "cuda:x", "gpu"]:
        with pytest.raises(InvalidArgument, match="device"):
            create_device_pool(small_layout(), 2, device=device)


def test_pool_handle_rejects_inconsistent_fields():
    layout = small_layout()
    with pytest.raises(InvalidArgument, match="nbytes"):
        PoolHandle("shm", layout, 2, 2 * layout.bytes_per_block + 1, name="x")
    with pytest.raises(InvalidArgument, match="name"):
        PoolHandle("shm", layout, 2, 2 * layout.bytes_per_block)
    with pytest.raises(InvalidArgument, match="ipc_handle"):
        PoolHandle("cuda_ipc", layout, 2, 2 * layout.bytes_per_block, device_index=0)
    with pytest.raises(InvalidArgument, match="kind"):
        PoolHandle("rdma", layout, 2, 2 * layout.bytes_per_block, name="x")
    assert pickle.loads(pickle.dumps(PoolHandle("shm", layout, 2, 1024, name="x"))).layout == layout
