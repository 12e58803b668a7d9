"""host.capacity_bytes and ssd.capacity_bytes are the node's budgets, shared by every layout: the
layouts' host slabs and SSD slot files together stay within them, and every layout still stores
and reads back its blocks."""

from __future__ import annotations

import glob
import os

import torch

from kvtierd.cli.kvtierctl_report import StatsView
from kvtierd.client import KvtierClient
from kvtierd.index.slot_entry import BlockMeta
from kvtierd.launch.daemon_process import WRITE_THROUGH, DaemonProcess, small_daemon_args, wait_until
from kvtierd.layout import Layout
from kvtierd.server import config_loader
from kvtierd.t2 import ssd_space
from kvtierd.t2.node_budget import NodeBudget
from kvtierd.t2.ssd_config import SsdTierConfig
from kvtierd.t2.ssd_space import SLOT_FILE_NAME
from kvtierd.t2.ssd_tier import SsdTier
from kvtierd.tier import Tier
from kvtierd.units import GiB, KiB, MiB
from tests.server.e2e_runner import expected_block, prompt

# 2 layers x 2 (K, V) x 16 tokens x 2 heads x 16 x 2 bytes = 4 KiB: one slot a block in T1 and T2.
LAYOUTS = [Layout(f"budget-model-{i}", 2, 2, 16, 16) for i in range(5)]
HOST_BYTES, SSD_BYTES = 800 * KiB, 1 * MiB  # for five layouts: 160 KiB of T1 each, 40 slots
NUM_CHAINS, CHAIN_BLOCKS = 6, 6  # per layout: 36 blocks, 144 KiB; 720 KiB in all


def slot_files(ssd_directory: str) -> list[os.stat_result]:
    return [os.stat(path) for path in glob.glob(os.path.join(ssd_directory, "*", SLOT_FILE_NAME))]


def host_segments(pid: int) -> list[os.stat_result]:
    return [os.stat(path) for path in glob.glob(f"/dev/shm/kvtierd-host-{pid}-*")]


def chain_blocks(client: KvtierClient, layout: Layout, seed: int):
    tokens = prompt(seed, CHAIN_BLOCKS * layout.block_size)
    hashes = client.attach(layout, map_pool=False).namespace.hash_blocks(tokens)
    size = layout.block_size
    return tokens, [(h, tokens[size * i:size * (i + 1)], expected_block(h, layout.bytes_per_block))
                    for i, h in enumerate(hashes)]


def t2_cached(client: KvtierClient) -> list[int]:
    return sorted(t.num_cached_blocks for p in client.stats().pools for t in p.tiers if t.tier == "t2")


def test_five_layouts_stay_within_the_node_budgets_and_each_reads_back_its_blocks(tmp_path):
    """Five model ids on one daemon: the host slabs (their /dev/shm segments) and the SSD slot
    files (sizes and blocks on disk) sum to at most host.capacity_bytes and ssd.capacity_bytes,
    Stats and kvtierctl show each layout's share beside the node's budget, and every block of
    every layout comes back byte for byte."""
    args = small_daemon_args(str(tmp_path), t0_bytes="128KiB", host_bytes=f"{HOST_BYTES}",
                             ssd_bytes=f"{SSD_BYTES}", extra=[*WRITE_THROUGH, "--set", "pool.max_layouts=5"])
    ssd_directory = str(tmp_path / "ssd")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        chains = {}
        for layout in LAYOUTS:
            for seed in range(NUM_CHAINS):
                tokens, blocks = chain_blocks(client, layout, seed)
                assert client.put(layout, blocks).num_blocks == CHAIN_BLOCKS
                chains[layout, seed] = tokens, blocks
        assert wait_until(lambda: t2_cached(client) == [NUM_CHAINS * CHAIN_BLOCKS] * len(LAYOUTS), timeout_s=30), \
            (t2_cached(client), [line for line in daemon.lines if any(w in line for w in ("SSD", "WARNING", "ERROR"))])

        def t1_rows() -> list:
            return [t for p in client.stats().pools for t in p.tiers if t.tier == "t1"]

        fair = HOST_BYTES // len(LAYOUTS) // 4096 * 4096  # the layouts that attached later took theirs back
        assert wait_until(lambda: [t.node_held_bytes for t in t1_rows()] == [fair] * len(LAYOUTS), timeout_s=30), \
            [t.node_held_bytes for t in t1_rows()]
        segments = host_segments(daemon.process.pid)
        assert len(segments) == len(LAYOUTS)  # every layout has its T1 slab (mapped for the whole budget) ...
        assert sum(s.st_blocks * 512 for s in segments) <= HOST_BYTES  # ... and their memory fits the node's
        files = slot_files(ssd_directory)
        assert len(files) == len(LAYOUTS)
        assert sum(f.st_size for f in files) <= SSD_BYTES
        assert sum(f.st_blocks * 512 for f in files) <= SSD_BYTES

        stats = client.stats()
        for tier, capacity in (("t1", HOST_BYTES), ("t2", SSD_BYTES)):
            rows = [t for p in stats.pools for t in p.tiers if t.tier == tier]
            assert len(rows) == len(LAYOUTS) and all(t.node_capacity_bytes == capacity for t in rows)
            assert sum(t.node_held_bytes for t in rows) <= capacity
            assert all(t.used_bytes <= t.capacity_bytes for t in rows)
        assert all(t.node_held_bytes == t.node_share_bytes == t.capacity_bytes == fair
                   for p in stats.pools for t in p.tiers if t.tier == "t1")
        text = "\n".join(StatsView(stats).lines(daemon.address))
        t1_part = "this layout's part of the node budgets: T1 memory 160.0 KiB (fair share 160.0 KiB), T2 files "
        assert "node budgets (all layouts): T1 host" in text and text.count(t1_part) == len(LAYOUTS)

        for (layout, seed), (tokens, blocks) in chains.items():
            got = client.get(layout, [h for h, _, _ in blocks], token_ids=tokens)
            assert [(h, data) for h, data in got] == [(h, data) for h, _, data in blocks], (layout.model_id, seed)


def ssd_blocks(layout: Layout, start: int, count: int) -> list[tuple[BlockMeta, bytes]]:
    items, parent = [], b"\x00" * 32
    for i in range(start, start + count):
        block_hash = i.to_bytes(4, "little") * 8
        meta = BlockMeta(block_hash, parent, bytes(4 * layout.block_size))
        items.append((meta, expected_block(block_hash, layout.bytes_per_block)))
        parent = block_hash
    return items


def loaded(tier: SsdTier, items) -> list[bytes]:
    out = torch.empty(len(items), tier.slot_nbytes, dtype=torch.uint8)
    num = tier.load([meta.block_hash for meta, _ in items], out)
    return [bytes(out[i].numpy()) for i in range(num)]


def test_a_layout_under_its_share_makes_the_one_above_give_back_disk(tmp_path):
    """A fills the node's 16 slots and reads back its first 4 blocks (its most recent now); B, under
    its share (8), gets room: A evicts its 8 least recently used blocks wherever they lie, moves the
    kept ones out of the end of its file and truncates it to 8 slots. The 8 it keeps read exactly,
    also after A reopens on its directory; neither ever exceeds the budget, and B at its share
    recycles its own least recently used slots. (Giving back the end of the file would keep
    blocks 0-7.)"""
    layout = LAYOUTS[0]
    budget = NodeBudget(16 * 4096, "ssd")

    def tier(name: str) -> SsdTier:
        return SsdTier.open(SsdTierConfig([str(tmp_path / name)], budget.capacity_bytes, durability="none",
                                          lmdb_map_bytes=16 << 20, node_budget=budget), layout)

    def on_disk() -> int:
        return sum(os.path.getsize(tmp_path / name / SLOT_FILE_NAME) for name in ("a", "b"))

    a_items = ssd_blocks(layout, 0, 16)  # block i in slot i
    a, b = tier("a"), tier("b")
    try:
        assert a.store(a_items) == 16
        assert budget.used_bytes == on_disk() == 16 * 4096 and a.stats().file_bytes == 16 * 4096
        # used again: LRU is 11, 10, ... 0, then 15 ... 12 (a chain's blocks read together leave tail first)
        assert loaded(a, a_items[12:]) == [data for _, data in a_items[12:]]
        assert b.store(ssd_blocks(layout, 100, 4)) == 4
        assert budget.used_bytes == on_disk() <= 16 * 4096
        assert a.stats().file_bytes == os.path.getsize(tmp_path / "a" / SLOT_FILE_NAME) == 8 * 4096
        assert b.stats().file_bytes == 8 * 4096
        kept = a_items[:4] + a_items[12:]  # the 8 most recently used: 12-15 moved from the end into 4-7
        assert sorted(a.block_hashes()) == sorted(meta.block_hash for meta, _ in kept)
        assert all(loaded(a, [item]) == [item[1]] for item in kept)
        assert a.stats().num_corrupted_blocks == 0 and a.stats().num_evictions == 8
        assert b.store(ssd_blocks(layout, 200, 6)) == 6  # up to its share, then its own LRU slots
        assert budget.used_bytes == on_disk() <= 16 * 4096 and b.stats().file_bytes == 8 * 4096
        assert loaded(b, ssd_blocks(layout, 200, 6)) == [data for _, data in ssd_blocks(layout, 200, 6)]
        first_chain = [meta.block_hash for meta, _ in ssd_blocks(layout, 100, 4)]
        assert [b.lookup([h]) for h in first_chain] == [1, 1, 0, 0]  # B's least recently used went: that chain's tail
        assert b.stats().share_bytes == 8 * 4096 and a.stats().node_used_bytes == 16 * 4096
        a.close()
        a = tier("a")  # a restart: the records name the kept blocks' new slots
        assert a.stats().num_recovered_blocks == 8 and a.stats().num_dropped_on_open == 0
        assert sorted(a.block_hashes()) == sorted(meta.block_hash for meta, _ in kept)
        assert all(loaded(a, [item]) == [item[1]] for item in kept)
        assert a.stats().num_corrupted_blocks == 0
    finally:
        a.close()
        b.close()


def test_slot_files_of_a_closed_layout_count_until_they_are_given_back(tmp_path):
    """A closed tier's files stay on disk and in the budget (dormant); a layout that needs the
    disk truncates them, and the closed layout reopens with what is left, exactly."""
    layout = LAYOUTS[0]
    budget = NodeBudget(8 * 4096, "ssd")
    config = {name: SsdTierConfig([str(tmp_path / name)], budget.capacity_bytes, durability="none",
                                  lmdb_map_bytes=16 << 20, node_budget=budget) for name in ("a", "b")}
    a = SsdTier.open(config["a"], layout)
    assert a.store(ssd_blocks(layout, 0, 8)) == 8
    a.close()
    assert budget.used_bytes == 8 * 4096
    b = SsdTier.open(config["b"], layout)
    assert b.store(ssd_blocks(layout, 100, 3)) == 3
    assert budget.used_bytes <= 8 * 4096
    assert os.path.getsize(tmp_path / "a" / SLOT_FILE_NAME) == 5 * 4096
    b.close()
    a = SsdTier.open(config["a"], layout)
    try:
        kept = [item for item in ssd_blocks(layout, 0, 8) if a.lookup([item[0].block_hash])]
        assert len(kept) == 5 and all(loaded(a, [item]) == [item[1]] for item in kept)
        assert budget.used_bytes <= 8 * 4096
    finally:
        a.close()


def test_the_default_ssd_budget_is_bounded_by_the_free_space(tmp_path, monkeypatch):
    """Not set: min(4 GiB, slot files there + half the free space); set: as given."""
    monkeypatch.setattr(ssd_space, "free_bytes", lambda path: 2 * GiB)
    environ = {"XDG_CACHE_HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path)}
    assert config_loader.load_config(environ=environ).ssd.capacity_bytes == 1 * GiB
    monkeypatch.setattr(ssd_space, "free_bytes", lambda path: 100 * GiB)
    assert config_loader.load_config(environ=environ).ssd.capacity_bytes == 4 * GiB
    monkeypatch.setattr(ssd_space, "free_bytes", lambda path: 2 * GiB)
    given = dict(environ, KVTIERD_SSD_CAPACITY_BYTES="3GiB")
    assert config_loader.load_config(environ=given).ssd.capacity_bytes == 3 * GiB


def test_one_layout_alone_takes_the_whole_host_budget_and_one_attached_later_gets_its_fair_share():
    """A alone holds all of T1 and fills it; B attaches and, within a bounded time, holds its fair
    share (half): A gave back its least recently used blocks, moved the ones it kept out of the end,
    and each still reads exactly; the layouts never hold more than the node's budget together."""
    from kvtierd.node.pool_config import PoolConfig
    from kvtierd.node.pools import PoolRegistry, PoolSettings
    from kvtierd.tiering.tier_config import TierConfig

    settings = PoolSettings(PoolConfig(device="cpu", t0_bytes=64 * KiB, max_layouts=4),
                            TierConfig(host_capacity_bytes=HOST_BYTES))
    registry = PoolRegistry(settings)
    try:
        host_a = registry.get_or_create(LAYOUTS[0]).manager.tiers.host
        assert host_a is not None and host_a.capacity_bytes == HOST_BYTES  # one layout: the whole budget
        items = ssd_blocks(LAYOUTS[0], 0, HOST_BYTES // 4096)  # 200 blocks of 4 KiB: T1 full
        half = len(items) // 2
        for stored in (items[:half], items[half:]):  # two stores: the first half is the least recently used
            plan = host_a.index.prepare_store([meta for meta, _ in stored])
            assert len(plan.stores) == len(stored) and not plan.evicted
            for entry, (_, data) in zip(plan.stores, stored):
                host_a.slots[entry.slot].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            host_a.index.complete_store(plan.stores, success=True)

        pool_b = registry.get_or_create(LAYOUTS[1])
        host_b = pool_b.manager.tiers.host
        assert host_b is not None
        assert wait_until(lambda: host_b.capacity_bytes == HOST_BYTES // 2, timeout_s=30), host_b.capacity_bytes
        assert host_a.capacity_bytes == HOST_BYTES // 2 and host_a.index.num_slots == len(items) // 2
        assert registry.host_budget.used_bytes == host_a.capacity_bytes + host_b.capacity_bytes <= HOST_BYTES
        kept = {e.block_hash: e for e in host_a.index.entries()}
        data_of = {meta.block_hash: data for meta, data in items}
        assert set(kept) == {meta.block_hash for meta, _ in items[len(items) // 2:]}  # the least recently used went
        for block_hash, entry in kept.items():
            assert entry.slot < host_a.index.num_slots and not entry.storing
            assert bytes(host_a.slots[entry.slot].numpy()) == data_of[block_hash]
        share = pool_b.node_share(Tier.T1)
        assert share is not None
        assert (share.held_bytes, share.share_bytes, share.node_capacity_bytes) == (HOST_BYTES // 2, HOST_BYTES // 2,
                                                                                    HOST_BYTES)
    finally:
        registry.close()


def test_on_a_daemon_a_second_model_takes_its_fair_share_of_t1_from_the_first_and_both_read_exactly(tmp_path):
    """A real daemon, T2 off: model A alone holds all of T1 and stores 24 blocks in it; model B
    attaches and stores 12; within a bounded time each holds half of T1, A gave up its least recently
    used chains, and every chain either model still holds in T1 comes back byte for byte."""
    host_bytes = 32 * 4096
    args = small_daemon_args(str(tmp_path), t0_bytes="32KiB", host_bytes=str(host_bytes), ssd_bytes="0",
                             extra=WRITE_THROUGH)

    def t1(client: KvtierClient, model: str):
        return next(t for p in client.stats().pools if p.layout.model_id == model for t in p.tiers if t.tier == "t1")

    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        a, b = LAYOUTS[0], LAYOUTS[1]
        chains_a = [chain_blocks(client, a, seed) for seed in range(4)]
        for _, blocks in chains_a:
            client.put(a, blocks)
        assert wait_until(lambda: t1(client, a.model_id).num_cached_blocks == 24, timeout_s=30)
        assert t1(client, a.model_id).capacity_bytes == host_bytes  # alone: the whole budget

        chains_b = [chain_blocks(client, b, seed) for seed in range(2)]  # B attaches (to hash its chains)
        half = host_bytes // 2
        assert wait_until(lambda: (t1(client, a.model_id).node_held_bytes, t1(client, b.model_id).node_held_bytes)
                          == (half, half), timeout_s=30), (t1(client, a.model_id), t1(client, b.model_id))
        for _, blocks in chains_b:
            client.put(b, blocks)
        assert wait_until(lambda: t1(client, b.model_id).num_cached_blocks == 12, timeout_s=30)
        assert t1(client, a.model_id).num_cached_blocks <= 16 and t1(client, a.model_id).node_share_bytes == half
        client.evict(tiers=["t0"])  # what comes back now comes from T1

        for layout, (tokens, blocks), whole in [(a, chains_a[2], True), (a, chains_a[3], True), (a, chains_a[0], False),
                                                *[(b, chain, True) for chain in chains_b]]:
            got = client.get(layout, [h for h, _, _ in blocks], token_ids=tokens)
            assert [(h, data) for h, data in got] == [(h, data) for h, _, data in blocks][:len(got)]
            assert (len(got) == CHAIN_BLOCKS) if whole else (len(got) == 0), (layout.model_id, len(got))
