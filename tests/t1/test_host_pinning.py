"""The host slab page-locked in the background: chunks of at most 64 GiB on slot boundaries, T1
serving the pinned prefix while the rest is pinned, every registration undone at close, no copy span
across two registrations. The registrar here records and paces the calls (cudaHostRegister needs a
GPU: the gpu test below pins for real)."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.cli.kvtierctl_report import StatsView
from kvtierd.index.slot_entry import BlockMeta
from kvtierd.launch.daemon_process import wait_until
from kvtierd.movers import pinned_regions
from kvtierd.t1.host_pinning import MAX_REGISTRATION_BYTES, parse_cpu_list, registration_chunks
from kvtierd.t1.host_slab import HostSlab
from kvtierd.t1.host_tier import HostTier
from kvtierd.units import GiB
from kvtierd.v1 import kvtier_pb2 as pb
from tests.factories import small_layout

LAYOUT = small_layout()


class PacedRegistrar:
    """Records register/unregister; each register waits for a permit when paced; may fail on call N."""

    def __init__(self, paced: bool = False, fail_on: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.permits = threading.Semaphore(0) if paced else None
        self.fail_on = fail_on
        self.arrived = threading.Semaphore(0)

    def register(self, address: int, nbytes: int) -> None:
        self.arrived.release()
        if self.permits is not None:
            assert self.permits.acquire(timeout=30), "the test never let this chunk go"
        if self.fail_on == len(self.registered):
            raise RuntimeError("cudaHostRegister failed with CUDA error 2")
        self.registered.append((address, nbytes))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def test_a_512_gib_slab_is_14_registrations_doubling_from_1_gib_none_above_64():
    chunks = registration_chunks(512 * GiB // (2 << 20), 2 << 20)
    sizes_gib = [(stop - start) * (2 << 20) / GiB for start, stop in chunks]
    assert sizes_gib == [1, 2, 4, 8, 16, 32, 64, 64, 64, 64, 64, 64, 64, 1]


@given(num_slots=st.integers(0, 5000), stride_pages=st.integers(1, 700),
       first=st.sampled_from([4096, 1 << 20, 3 << 20]), max_mib=st.integers(1, 64))
def test_chunks_cover_the_slab_in_order_on_slot_boundaries(num_slots, stride_pages, first, max_mib):
    stride, max_bytes = stride_pages * 4096, max_mib << 20
    chunks = registration_chunks(num_slots, stride, first, max_bytes)
    assert [start for start, _ in chunks] == ([0] if chunks else []) + [stop for _, stop in chunks[:-1]]
    assert (chunks[-1][1] if chunks else 0) == num_slots
    assert all(stop > start for start, stop in chunks)
    assert all((stop - start) * stride <= max_bytes for start, stop in chunks if stop - start > 1)


def test_the_default_cap_is_64_gib():
    assert MAX_REGISTRATION_BYTES == 64 * GiB


def test_t1_serves_the_pinned_prefix_while_the_rest_is_pinned(caplog):
    registrar = PacedRegistrar(paced=True)
    codec_bytes = LAYOUT.bytes_per_block
    slab = HostSlab(10, codec_bytes, pin=True, registrar=registrar, chunks=[(0, 2), (2, 6), (6, 10)])
    host = HostTier(LAYOUT, 0, slab=slab)
    try:
        assert host.index.num_slots == 0 and host.pinning and host.pinned_bytes == 0
        assert not host.index.prepare_store([meta(0)]).stores  # nothing pinned: nothing stored
        with caplog.at_level(logging.INFO, logger="kvtierd.t1.host_pinning"):
            registrar.permits.release()  # the first chunk: two slots
            assert wait_until(lambda: host.index.num_slots == 2, timeout_s=30)
        plan = host.index.prepare_store([meta(i) for i in range(1, 6)])
        assert sorted(e.slot for e in plan.stores) == [0, 1]  # only pinned slots are handed out
        assert host.pinning and host.pinned_bytes == 2 * slab.stride
        assert any("page-locked" in r.getMessage() for r in caplog.records)
        registrar.permits.release(2)
        assert slab.wait_pinned(30)
        assert host.index.num_slots == 10 and not host.pinning and host.pinned_bytes == slab.nbytes
        starts = [address for address, _ in registrar.registered]
        base = slab.segment.flat.data_ptr()
        assert starts == [base, base + 2 * slab.stride, base + 6 * slab.stride]
        assert [n for _, n in registrar.registered] == [2 * slab.stride, 4 * slab.stride, 4 * slab.stride]
    finally:
        host.close()
    assert registrar.unregistered == starts[::-1]  # every registration undone, last first
    assert not pinned_regions._boundaries


def test_a_failed_registration_keeps_what_was_pinned_and_undoes_it_at_close():
    registrar = PacedRegistrar(fail_on=1)
    slab = HostSlab(6, LAYOUT.bytes_per_block, pin=True, registrar=registrar, chunks=[(0, 3), (3, 6)])
    host = HostTier(LAYOUT, 0, slab=slab)
    try:
        assert slab.wait_pinned(30)
        assert host.index.num_slots == 3 and not host.pinning and slab.pinning_stopped
    finally:
        host.close()
    assert len(registrar.unregistered) == 1 and not pinned_regions._boundaries


def test_closing_while_pinning_stops_after_the_chunk_in_progress():
    registrar = PacedRegistrar(paced=True)
    slab = HostSlab(6, LAYOUT.bytes_per_block, pin=True, registrar=registrar, chunks=[(0, 2), (2, 4), (4, 6)])
    host = HostTier(LAYOUT, 0, slab=slab)
    assert registrar.arrived.acquire(timeout=30)  # the first chunk is waiting to register
    closer = threading.Thread(target=host.close)
    closer.start()
    registrar.permits.release(3)
    closer.join(30)
    assert not closer.is_alive()
    assert len(registrar.registered) == 1 and registrar.unregistered == [registrar.registered[0][0]]


def test_an_unpinned_slab_is_usable_at_once():
    host = HostTier(LAYOUT, 4 * 4096, pin=False)  # 4 slots of one page
    try:
        assert host.index.num_slots == 4 and not host.pinning and host.pinned_bytes == 0
    finally:
        host.close()


def test_a_copy_span_across_two_registrations_is_cut_there():
    base = 1 << 40
    pinned_regions.add(base, 4096)
    pinned_regions.add(base + 4096, 8192)
    try:
        hosts = np.array([base, base + 1000, base + 12288], dtype=np.uint64)
        others = np.array([7 << 30, 8 << 30, 9 << 30], dtype=np.uint64)
        sizes = np.array([4096, 8000, 100], dtype=np.uint64)
        cut_hosts, cut_others, cut_sizes = pinned_regions.split_spans(hosts, others, sizes)
        assert cut_hosts.tolist() == [base, base + 1000, base + 4096, base + 12288]
        assert cut_others.tolist() == [7 << 30, 8 << 30, (8 << 30) + 3096, 9 << 30]
        assert cut_sizes.tolist() == [4096, 3096, 4904, 100]
        whole = pinned_regions.split_spans(hosts[:1], others[:1], sizes[:1])  # inside one registration
        assert [a.tolist() for a in whole] == [[base], [7 << 30], [4096]]
    finally:
        pinned_regions.remove(base, 4096)
        pinned_regions.remove(base + 4096, 8192)


def test_cpu_lists_as_the_kernel_writes_them():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("") == set()


def test_kvtierctl_stats_says_how_far_page_locking_got():
    t1 = pb.TierStats(tier="t1", capacity_bytes=64 * GiB, pinned_bytes=7 * GiB, pinning=True)
    pool = pb.PoolStats(layout=pb.Layout(model_id="m", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                                         dtype="float16"), tiers=[pb.TierStats(tier="t0"), t1])
    text = "\n".join(StatsView(pb.StatsResponse(pools=[pool])).lines("unix:///x"))
    assert "T1 page-locking: 7.0 GiB of 64.0 GiB so far" in text
    done = pb.StatsResponse(pools=[pb.PoolStats(layout=pool.layout, tiers=[pb.TierStats(tier="t1", pinning=False)])])
    assert "page-locking" not in "\n".join(StatsView(done).lines("unix:///x"))


@pytest.mark.gpu
def test_on_cuda_the_slab_is_pinned_in_chunks_and_copies_across_them_are_exact():
    """Real cudaHostRegister in three chunks; a shuffled batch into and out of all of them lands exactly."""
    from kvtierd.movers.span_copy import copy_rows

    slot_nbytes = 256 << 10
    slab = HostSlab(24, slot_nbytes, pin=True, chunks=[(0, 5), (5, 13), (13, 24)])
    try:
        slab.start_pinning(lambda num_ready: None)
        assert slab.wait_pinned(60) and slab.num_ready_slots == 24 and not slab.pinning_stopped
        device = torch.randint(0, 256, (24, slot_nbytes), dtype=torch.uint8, device="cuda")
        ids = [i * 7 % 24 for i in range(24)]
        copy_rows(slab.slots, list(range(24)), device, ids)
        torch.cuda.synchronize()
        assert torch.equal(slab.slots, device[ids].cpu())
        back = torch.zeros_like(device)
        copy_rows(back, ids, slab.slots, list(range(24)))
        torch.cuda.synchronize()
        assert torch.equal(back, device)
    finally:
        slab.close()


def meta(i: int) -> BlockMeta:
    return BlockMeta(bytes([i]) * 33, bytes([i + 1]) * 33, b"\0" * 16)

