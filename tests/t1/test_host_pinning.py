"""The host slab page-locked grain by grain as its extent grows: grains of at most 1 GiB on slot
boundaries, T1 serving each grain as it lands, grains unregistered and their pages given back as the
extent shrinks, every registration undone at close, no copy span across two registrations. The
registrar here records and paces the calls (cudaHostRegister needs a GPU: the gpu test pins for real)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from kvtierd.cli.kvtierctl_report import StatsView
from kvtierd.launch.daemon_process import wait_until
from kvtierd.movers import pinned_regions
from kvtierd.t1.host_pinning import GRAIN_BYTES, grain_slots, parse_cpu_list
from kvtierd.t1.host_slab import HostSlab
from kvtierd.t1.host_tier import HostTier
from kvtierd.units import GiB
from kvtierd.v1 import kvtier_pb2 as pb
from tests.factories import small_layout

LAYOUT = small_layout()  # 512-byte blocks: one 4 KiB slot each


class PacedRegistrar:
    """Records register/unregister; each register waits for a permit when paced; may fail on call N."""

    def __init__(self, paced: bool = False, fail_on: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.permits = threading.Semaphore(0) if paced else None
        self.fail_on = fail_on

    def register(self, address: int, nbytes: int) -> None:
        if self.permits is not None:
            assert self.permits.acquire(timeout=30), "the test never let this grain go"
        if self.fail_on == len(self.registered):
            raise RuntimeError("cudaHostRegister failed with CUDA error 2")
        self.registered.append((address, nbytes))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def resident_bytes(slab: HostSlab) -> int:
    return os.fstat(slab.segment.fd).st_blocks * 512


def test_grains_are_at_most_1_gib_of_whole_slots():
    assert GRAIN_BYTES == 1 * GiB <= 64 * GiB  # a 512 GiB tier is 512 registrations, none of them refused
    assert grain_slots(2 << 20) == 512 and grain_slots(720 << 10) == 1456  # 1456 x 720 KiB < 1 GiB
    assert grain_slots(3 * GiB) == 1  # a slot above a grain is a grain of its own


def test_the_extent_is_pinned_and_given_back_grain_by_grain():
    registrar = PacedRegistrar()
    slab = HostSlab(10, 4096, pin=True, registrar=registrar, grain=4)
    try:
        assert slab.nbytes == 0 and resident_bytes(slab) == 0  # mapped for 10 slots, backed for none
        ready = []
        slab.extend_to(5, ready.append)  # 5 slots: two grains
        assert ready == [4, 8] and slab.num_ready_slots == 8 and resident_bytes(slab) == 8 * 4096
        base = slab.flat.data_ptr()
        assert registrar.registered == [(base, 4 * 4096), (base + 4 * 4096, 4 * 4096)]
        slab.extend_to(10)
        assert slab.num_ready_slots == 10 and registrar.registered[-1] == (base + 8 * 4096, 2 * 4096)  # the end
        assert slab.shrink_to(5) == 8  # a grain is given back whole, or not at all
        assert registrar.unregistered == [base + 8 * 4096] and resident_bytes(slab) == 8 * 4096
        assert slab.shrink_to(0) == 0 and resident_bytes(slab) == 0
        assert registrar.unregistered == [base + 8 * 4096, base + 4 * 4096, base]
        assert not pinned_regions._boundaries
    finally:
        slab.close()


def test_a_refused_registration_keeps_the_grains_before_it():
    registrar = PacedRegistrar(fail_on=1)
    slab = HostSlab(8, 4096, pin=True, registrar=registrar, grain=4)
    try:
        with pytest.raises(RuntimeError, match="cudaHostRegister"):
            slab.extend_to(8)
        assert slab.num_ready_slots == 4
    finally:
        slab.close()
    assert len(registrar.unregistered) == 1 and not pinned_regions._boundaries


def test_t1_serves_the_grains_pinned_so_far_while_the_rest_are_pinned():
    """The first grain is pinned when the tier is made, the others on the share's thread; a store
    meanwhile gets only pinned slots."""
    registrar = PacedRegistrar(paced=True)
    slab = HostSlab(12, LAYOUT.bytes_per_block, pin=True, registrar=registrar, grain=4)
    registrar.permits.release()  # the first grain: pinned while the tier is made
    host = HostTier(LAYOUT, 12 * 4096, slab=slab)
    try:
        assert host.index.num_slots == 4  # T1 serves its first grain at once, the rest as they are pinned
        assert wait_until(lambda: host.share.growing, timeout_s=30)  # the second grain waits for its permit
        assert host.pinning and host.pinned_bytes == 4 * 4096
        plan = host.index.prepare_store([meta(i) for i in range(1, 7)])
        assert sorted(e.slot for e in plan.stores) == [0, 1, 2, 3]  # only pinned slots are handed out
        host.index.complete_store(plan.stores, success=True)
        registrar.permits.release(2)
        assert wait_until(lambda: host.index.num_slots == 12 and not host.pinning, timeout_s=30)
        assert host.capacity_bytes == host.pinned_bytes == 12 * 4096
    finally:
        host.close()
    assert len(registrar.unregistered) == 3 and not pinned_regions._boundaries


def test_an_unpinned_tier_is_backed_at_once_and_gives_its_pages_back_at_close():
    host = HostTier(LAYOUT, 4 * 4096, pin=False)  # 4 slots of one page
    assert host.index.num_slots == 4 and not host.pinning and host.pinned_bytes == 0
    assert resident_bytes(host.slab) == 4 * 4096
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
def test_on_cuda_the_slab_is_pinned_in_grains_and_copies_across_them_are_exact():
    """Real cudaHostRegister in three grains; a shuffled batch into and out of all of them lands exactly."""
    from kvtierd.movers.span_copy import copy_rows

    slot_nbytes = 256 << 10
    slab = HostSlab(24, slot_nbytes, pin=True, grain=9)
    try:
        slab.extend_to(24)
        assert slab.num_ready_slots == 24
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


def meta(i: int):
    from kvtierd.index.slot_entry import BlockMeta

    return BlockMeta(bytes([i]) * 33, bytes([i + 1]) * 33, b"\0" * 16)
