"""The SSD tier with encryption on, tested as an attacker would: read the slot files for a known
block's bytes, swap two slots on disk, forget a tenant and restart; and the tier still round-trips,
recovers and gives disk back."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvtierd.daemon_key import TenantTag
from kvtierd.index.slot_entry import BlockMeta
from kvtierd.layout import Layout
from kvtierd.sealing.block_seal import SEAL_OVERHEAD_BYTES
from kvtierd.sealing.key_directory import KeyDirectory
from kvtierd.sealing.master_key import MasterKey
from kvtierd.sealing.tenant_keys import TenantKeys
from kvtierd.t2.node_budget import NodeBudget
from kvtierd.t2.ssd_files import SLOT_FILE_NAME
from kvtierd.t2.ssd_tier import SsdTier, SsdTierConfig
from kvtierd.token_bytes import TokenBytes
from tests.factories import small_layout
from tests.t2.ssd_crash_writer import expected_bytes

LAYOUT = small_layout()  # 512 bytes a block
MASTER = MasterKey(b"\x07" * 32)
ALICE, BOB = TenantTag(b"A" * 16), TenantTag(b"B" * 16)


def tenant_chain(tag: TenantTag, n: int, nbytes: int = LAYOUT.bytes_per_block) -> list[tuple[BlockMeta, bytes]]:
    """n chained blocks of one tenant (keys tag + client hash), bytes a function of the key."""
    items, parent = [], tag + b"\xee" * 16
    for i in range(n):
        key = tag + i.to_bytes(4, "little") * 4
        items.append((BlockMeta(key, parent, tokens_of(key)), expected_bytes(key, nbytes)))
        parent = key
    return items


def tokens_of(key: bytes) -> TokenBytes:
    """A block's 4 token ids (16 bytes), a function of its key that shares no bytes with it."""
    return TokenBytes(hashlib.sha256(b"tokens" + key).digest()[:4 * LAYOUT.block_size])


def keys_of(items) -> list[bytes]:
    return [meta.block_hash for meta, _ in items]


def tenant_keys(tmp_path) -> TenantKeys:
    return TenantKeys(MASTER, KeyDirectory.open(str(tmp_path / "keys"), MASTER))


def open_tier(tmp_path, keys: TenantKeys | None, num_slots: int = 32, layout: Layout = LAYOUT,
              nbytes: int | None = None, **overrides) -> SsdTier:
    config = SsdTierConfig([str(tmp_path / "t2")], capacity_bytes=num_slots * 8192, lmdb_map_bytes=16 << 20,
                           tenant_keys=keys, **overrides)
    return SsdTier.open(config, layout, nbytes)


def loaded(tier: SsdTier, keys: list[bytes], nbytes: int = LAYOUT.bytes_per_block) -> tuple[int, list[bytes]]:
    out = torch.full((len(keys), nbytes), 0x5A, dtype=torch.uint8)
    num_loaded = tier.load(keys, out)
    return num_loaded, [bytes(row.numpy()) for row in out]


def slot_file_bytes(tmp_path) -> bytes:
    with open(tmp_path / "t2" / SLOT_FILE_NAME, "rb") as f:
        return f.read()


@pytest.mark.parametrize("nbytes", [512, 8192, 23040])
@pytest.mark.parametrize("o_direct", [True, False])
def test_sealed_blocks_come_back_exact_and_after_a_restart(tmp_path, nbytes, o_direct):
    """Sealed slots are the block plus the seal's overhead, rounded to 4 KiB (a 8 KiB block takes 12 KiB);
    bytes come back bit for bit, and again from a restarted tier with the same keys."""
    items = tenant_chain(ALICE, 6, nbytes)
    tier = open_tier(tmp_path, tenant_keys(tmp_path), nbytes=nbytes, o_direct=o_direct)
    try:
        assert tier.stride == -(-(nbytes + SEAL_OVERHEAD_BYTES) // 4096) * 4096
        assert tier.store(items) == 6
        assert loaded(tier, keys_of(items), nbytes) == (6, [data for _, data in items])
        assert tier.stats().sealed
    finally:
        tier.close()
    tier = open_tier(tmp_path, tenant_keys(tmp_path), nbytes=nbytes, o_direct=o_direct)
    try:
        assert tier.stats().num_recovered_blocks == 6
        assert loaded(tier, keys_of(items), nbytes) == (6, [data for _, data in items])
    finally:
        tier.close()


@pytest.mark.parametrize("sealed", [True, False])
def test_the_slot_files_hold_no_known_block_bytes_when_sealed(tmp_path, sealed):
    """Every 64-byte window of every stored block is searched for in the slot file: none is there
    sealed; in the clear (the control, so that this test can fail) every block is found."""
    items = tenant_chain(ALICE, 8)
    tier = open_tier(tmp_path, tenant_keys(tmp_path) if sealed else None)
    try:
        assert tier.store(items) == 8
    finally:
        tier.close()
    on_disk = slot_file_bytes(tmp_path)
    found = [any(data[i:i + 64] in on_disk for i in range(0, len(data) - 64, 64)) for _, data in items]
    assert found == [not sealed] * 8
    index = b"".join(p.read_bytes() for p in (tmp_path / "t2").rglob("*") if p.is_file() and p.name != SLOT_FILE_NAME)
    assert [meta.token_ids in index for meta, _ in items] == [not sealed] * 8  # the prompt's token ids
    if sealed:
        key_files = b"".join(p.read_bytes() for p in (tmp_path / "keys").iterdir())
        assert all(data[:64] not in key_files for _, data in items)


def test_two_slots_swapped_on_disk_are_misses_counted_and_never_served(tmp_path):
    """Alice's block 1 and Bob's block 0 trade slots on disk: both fail to open as their own key's,
    are misses (rows zeroed, not the other's bytes), counted as unauthentic, and dropped; the rest load."""
    alice, bob = tenant_chain(ALICE, 3), tenant_chain(BOB, 2)
    tier = open_tier(tmp_path, tenant_keys(tmp_path), durability="fdatasync")
    try:
        assert tier.store(alice) == 3 and tier.store(bob) == 2
        stride = tier.stride
        slot_of = {e.block_hash: e.slot for e in tier._index.entries()}
        first, second = slot_of[keys_of(alice)[1]], slot_of[keys_of(bob)[0]]
        with open(tmp_path / "t2" / SLOT_FILE_NAME, "r+b") as f:
            f.seek(first * stride)
            a_record = f.read(stride)
            f.seek(second * stride)
            b_record = f.read(stride)
            f.seek(first * stride)
            f.write(b_record)
            f.seek(second * stride)
            f.write(a_record)
        num_loaded, rows = loaded(tier, keys_of(alice))
        assert num_loaded == 1 and rows[0] == alice[0][1]
        assert rows[1] == bytes(LAYOUT.bytes_per_block)  # zeroed: neither Alice's nor Bob's bytes
        assert loaded(tier, keys_of(bob)[:1])[0] == 0
        stats = tier.stats()
        assert stats.num_unauthentic_blocks == 2 and stats.num_corrupted_blocks == 0
        assert not tier.holds(keys_of(alice)[1]) and not tier.holds(keys_of(bob)[0])
        assert loaded(tier, keys_of(alice)[2:])[0] == 1 and loaded(tier, keys_of(bob)[1:])[0] == 1
    finally:
        tier.close()


def test_a_forgotten_tenant_opens_nothing_here_or_after_a_restart_and_another_is_untouched(tmp_path):
    """Forget Alice's key: her blocks still indexed are misses at once (counted), and after a restart
    too; Bob's load exactly; Alice's next store seals under a new key that then loads."""
    alice, bob = tenant_chain(ALICE, 4), tenant_chain(BOB, 4)
    keys = tenant_keys(tmp_path)
    tier = open_tier(tmp_path, keys)
    try:
        assert tier.store(alice) == 4 and tier.store(bob) == 4
        assert keys.forget(ALICE)
        assert loaded(tier, keys_of(alice)[2:])[0] == 0
        assert tier.stats().num_unauthentic_blocks == 2 and not tier.holds(keys_of(alice)[2])
    finally:
        tier.close()
    tier = open_tier(tmp_path, tenant_keys(tmp_path))
    try:
        assert tier.stats().num_dropped_on_open == 2  # her records' token ids no longer open: dropped at once
        assert not tier.holds(keys_of(alice)[0]) and loaded(tier, keys_of(alice)[:2])[0] == 0
        assert loaded(tier, keys_of(bob)) == (4, [data for _, data in bob])
        assert tier.store(alice[:2]) == 2
        assert loaded(tier, keys_of(alice)[:2]) == (2, [data for _, data in alice[:2]])
    finally:
        tier.close()


def test_switching_encryption_on_drops_the_clear_blocks_at_open(tmp_path):
    """Blocks stored in the clear are not served by a sealed tier (nor sealed ones by a clear tier):
    their records name another slot size and are dropped at open."""
    items = tenant_chain(ALICE, 3)
    tier = open_tier(tmp_path, None)
    assert tier.store(items) == 3
    tier.close()
    tier = open_tier(tmp_path, tenant_keys(tmp_path))
    try:
        assert tier.stats().num_dropped_on_open == 3 and loaded(tier, keys_of(items))[0] == 0
        assert tier.store(items) == 3
    finally:
        tier.close()
    tier = open_tier(tmp_path, None)
    try:
        assert tier.stats().num_dropped_on_open == 3 and loaded(tier, keys_of(items))[0] == 0
    finally:
        tier.close()


def test_a_sealed_tier_gives_disk_back_and_its_moved_blocks_still_open(tmp_path):
    """A sealed tier holding 8 blocks gives half its disk to another layout: the 4 it keeps (the most
    recently used) are moved, re-sealed, and load exactly; nothing is counted unauthentic."""
    items = tenant_chain(ALICE, 8)
    keys = tenant_keys(tmp_path)
    probe = open_tier(tmp_path / "probe", keys)
    stride = probe.stride
    probe.close()
    budget = NodeBudget(8 * stride, "ssd")
    a = open_tier(tmp_path / "a", keys, num_slots=8, node_budget=budget)
    b = open_tier(tmp_path / "b", None, num_slots=8, node_budget=budget)
    try:
        assert a.store(items) == 8
        assert loaded(a, keys_of(items)[6:])[0] == 2  # 6 and 7 used last: they are kept, moved where needed
        assert b.store(tenant_chain(BOB, 4)) == 4
        kept = sorted(a.block_hashes())
        assert len(kept) == 4 and set(keys_of(items)[6:]) <= set(kept)
        for key in kept:
            assert loaded(a, [key]) == (1, [dict(zip(keys_of(items), (d for _, d in items)))[key]])
        assert a.stats().num_unauthentic_blocks == 0
    finally:
        a.close()
        b.close()
