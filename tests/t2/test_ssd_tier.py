"""The T2 SSD tier: exact round trips, recovery across restarts, layout checks, watermarks,
verification, O_DIRECT and its fallback, write errors."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os

import pytest
import torch

from kvtierd.errors import FailedPrecondition, InvalidArgument
from kvtierd.index.slot_entry import BlockMeta
from kvtierd.layout import Layout
from kvtierd.t2 import ssd_files
from kvtierd.t2.ssd_tier import SsdTier, SsdTierConfig
from tests.factories import small_layout
from tests.t2.ssd_crash_writer import expected_bytes, expected_tokens

ROOT = b"\xee" * 32
LAYOUT = small_layout()  # 512 bytes a block, 4 tokens


def chain(n: int, start: int = 0, layout: Layout = LAYOUT, nbytes: int | None = None) -> list[tuple[BlockMeta, bytes]]:
    """n chained blocks whose bytes and tokens are functions of their hash."""
    items, parent = [], ROOT
    for i in range(start, start + n):
        block_hash = i.to_bytes(4, "little") * 8
        meta = BlockMeta(block_hash, parent if i > start else ROOT, expected_tokens(block_hash, layout.block_size))
        items.append((meta, expected_bytes(block_hash, nbytes or layout.bytes_per_block)))
        parent = block_hash
    return items


def hashes(items) -> list[bytes]:
    return [meta.block_hash for meta, _ in items]


def config(tmp_path, num_slots: int, stride: int = 4096, num_dirs: int = 1, **overrides) -> SsdTierConfig:
    directories = [str(tmp_path / f"nvme{i}") for i in range(num_dirs)]
    return SsdTierConfig(directories, capacity_bytes=num_slots * stride, lmdb_map_bytes=64 << 20, **overrides)


def load_bytes(tier: SsdTier, block_hashes: list[bytes], nbytes: int = LAYOUT.bytes_per_block, **kwargs):
    out = torch.zeros(len(block_hashes), nbytes, dtype=torch.uint8)
    num_loaded = tier.load(block_hashes, out, **kwargs)
    return num_loaded, [bytes(out[i].numpy()) for i in range(num_loaded)]


@pytest.fixture
def open_tiers():
    tiers = []

    def open_tier(cfg, layout=LAYOUT, slot_nbytes=None):
        tier = SsdTier.open(cfg, layout, slot_nbytes)
        tiers.append(tier)
        return tier

    yield open_tier
    for tier in tiers:
        tier.close()


@pytest.mark.parametrize("nbytes", [512, 8192, 23040])
@pytest.mark.parametrize("o_direct", [True, False])
def test_store_then_load_returns_the_exact_bytes(tmp_path, open_tiers, nbytes, o_direct):
    """Bytes, tensors and unaligned or aligned sizes all come back bit for bit, over two files."""
    tier = open_tiers(config(tmp_path, 32, stride=-(-nbytes // 4096) * 4096, num_dirs=2, o_direct=o_direct),
                      slot_nbytes=nbytes)
    items = chain(10, nbytes=nbytes)
    items[3] = (items[3][0], torch.frombuffer(bytearray(items[3][1]), dtype=torch.uint8))  # a tensor
    assert tier.store(items) == 10
    assert tier.store(items) == 0  # already there
    num_loaded, loaded = load_bytes(tier, hashes(items), nbytes)
    assert num_loaded == 10
    assert loaded == [expected_bytes(h, nbytes) for h in hashes(items)]
    stats = tier.stats()
    assert (stats.bytes_written, stats.bytes_read, stats.num_cached_blocks) == (10 * nbytes, 10 * nbytes, 10)


def test_load_returns_the_leading_hits_only(tmp_path, open_tiers):
    """A missing block ends the prefix: later blocks are not reported loaded."""
    tier = open_tiers(config(tmp_path, 16))
    items = chain(4)
    assert tier.store(items[:2] + items[3:]) == 3
    assert tier.lookup(hashes(items)) == 2
    num_loaded, loaded = load_bytes(tier, hashes(items))
    assert num_loaded == 2 and loaded == [expected_bytes(h, 512) for h in hashes(items)[:2]]


def test_parent_and_tokens_verify_a_hit(tmp_path, open_tiers):
    """A lookup or load carrying the wrong parent or tokens is a miss, never another block."""
    tier = open_tiers(config(tmp_path, 16))
    items = chain(3)
    tier.store(items)
    tokens = b"".join(meta.token_ids for meta, _ in items)
    assert tier.lookup(hashes(items), parent=ROOT, token_bytes=tokens, block_size=4) == 3
    assert tier.lookup(hashes(items), parent=b"\x01" * 32) == 0
    wrong = tokens[:16] + bytes(16) + tokens[32:]
    assert tier.lookup(hashes(items), token_bytes=wrong, block_size=4) == 1
    assert load_bytes(tier, hashes(items), token_bytes=wrong, block_size=4)[0] == 1
    assert load_bytes(tier, hashes(items), parent=b"\x01" * 32)[0] == 0


def test_restart_keeps_hits_bytes_and_lru_order(tmp_path):
    """Close + open serves the same blocks, and the last-use order survives the restart."""
    cfg = config(tmp_path, 8, num_dirs=2, high_watermark=1.0, low_watermark=1.0)
    items = chain(8)
    tier = SsdTier.open(cfg, LAYOUT)
    for item in items:
        tier.store([item])
    assert load_bytes(tier, hashes(items)[:1])[0] == 1  # block 0 is now the most recent
    tier.close()
    tier = SsdTier.open(cfg, LAYOUT)
    try:
        assert tier.stats().num_recovered_blocks == 8 and tier.lookup(hashes(items)) == 8
        tier.store(chain(1, start=100))  # full: evicts the least recently used, which is block 1
        held = set(tier.block_hashes())
        assert hashes(items)[0] in held and hashes(items)[1] not in held
    finally:
        tier.close()
    tier = SsdTier.open(cfg, LAYOUT)
    try:
        kept = hashes(items)[:1] + hashes(items)[2:]
        assert [load_bytes(tier, [h]) for h in kept] == [(1, [expected_bytes(h, 512)]) for h in kept]
    finally:
        tier.close()


def test_events_announce_the_blocks_recovered_on_open_then_stores_and_evictions(tmp_path):
    """After a restart, enabling events queues every recovered block as stored (a router learns
    what T2 holds); a later store that evicts says removed then stored."""
    from kvtierd.index.index_events import BlockRemoved, BlockStored

    cfg = config(tmp_path, 4, high_watermark=1.0, low_watermark=1.0)
    items = chain(5)
    with contextlib.closing(SsdTier.open(cfg, LAYOUT)) as tier:
        tier.store(items[:4])
        assert tier.take_events() == []  # off by default
    with contextlib.closing(SsdTier.open(cfg, LAYOUT)) as tier:
        tier.enable_events(100)
        recovered = tier.take_events()
        assert sorted((e.block_hash, e.parent_hash, e.token_ids) for e in recovered) == sorted(
            (m.block_hash, m.parent_hash, m.token_ids) for m, _ in items[:4])
        assert all(isinstance(e, BlockStored) for e in recovered)
        tier.store(items[4:])
        removed, stored = tier.take_events()
        assert isinstance(removed, BlockRemoved) and removed.block_hash in hashes(items[:4])
        assert stored == BlockStored(items[4][0].block_hash, items[4][0].parent_hash, stored.block_id,
                                     items[4][0].token_ids)


def test_another_layouts_entries_are_dropped_on_open(tmp_path):
    """Entries of another layout fingerprint, or of another slot size (fp8), are dropped for good."""
    cfg = config(tmp_path, 16)
    tier = SsdTier.open(cfg, LAYOUT)
    tier.store(chain(5))
    tier.close()
    other = small_layout(model_id="another-model")
    tier = SsdTier.open(cfg, other)
    assert tier.stats().num_dropped_on_open == 5 and tier.lookup(hashes(chain(5))) == 0
    tier.store(chain(3, start=50, layout=other))
    tier.close()
    tier = SsdTier.open(cfg, LAYOUT)  # back to the first layout: its entries are gone
    assert tier.block_hashes() == [] and tier.stats().num_dropped_on_open == 3
    tier.close()
    tier = SsdTier.open(cfg, other, slot_nbytes=256)  # same layout, half the bytes: another format
    assert tier.block_hashes() == []
    tier.close()


def test_entries_outside_the_files_are_dropped_when_capacity_shrinks(tmp_path):
    """After a capacity cut, entries past the end of the files go; the rest still verify."""
    tier = SsdTier.open(config(tmp_path, 16, high_watermark=1.0, low_watermark=1.0), LAYOUT)
    items = chain(16)
    assert tier.store(items) == 16
    tier.close()
    tier = SsdTier.open(config(tmp_path, 6), LAYOUT)
    try:
        held = tier.block_hashes()
        assert len(held) == 6 and tier.stats().num_dropped_on_open == 10
        assert [load_bytes(tier, [h])[1] for h in held] == [[expected_bytes(h, 512)] for h in held]
    finally:
        tier.close()


def test_watermarks_evict_least_recently_used_down_to_low(tmp_path, open_tiers):
    """Above high * capacity after a store, the oldest entries go until low * capacity is left (a
    chain stored together tail first), and they are gone from the persistent index too."""
    cfg = config(tmp_path, 20, high_watermark=0.9, low_watermark=0.5)  # high 18 slots, low 10
    tier = SsdTier.open(cfg, LAYOUT)
    items = chain(19)
    assert tier.store(items[:18]) == 18
    assert tier.stats().num_cached_blocks == 18  # at high, not above
    assert tier.store(items[18:]) == 1
    stats = tier.stats()
    assert stats.num_cached_blocks == 10 and stats.used_bytes == 10 * 4096 and stats.num_evictions == 9
    kept = hashes(items)[:9] + hashes(items)[18:]  # 17 down to 9 went: the first 18's prefix stays
    assert set(tier.block_hashes()) == set(kept) and tier.lookup(hashes(items)) == 9
    tier.close()
    reopened = open_tiers(cfg)
    assert set(reopened.block_hashes()) == set(kept)


def test_remove_drops_entries_for_good(tmp_path):
    cfg = config(tmp_path, 8)
    tier = SsdTier.open(cfg, LAYOUT)
    items = chain(4)
    tier.store(items)
    assert tier.remove(hashes(items)[1:3] + [b"\x99" * 32]) == 2
    tier.close()
    tier = SsdTier.open(cfg, LAYOUT)
    assert sorted(tier.block_hashes()) == sorted([hashes(items)[0], hashes(items)[3]])
    tier.close()


def test_stats_report_capacity_usage_and_flags(tmp_path, open_tiers):
    tier = open_tiers(config(tmp_path, 10, num_dirs=2, durability="none"))
    tier.store(chain(3))
    stats = tier.stats()
    assert stats.capacity_bytes == 10 * 4096 and stats.used_bytes == 3 * 4096
    assert (stats.num_cached_blocks, stats.num_corrupted_blocks, stats.num_io_errors) == (3, 0, 0)
    assert stats.admitting is True and stats.reason == "" and stats.durability == "none"
    assert os.path.getsize(tmp_path / "nvme0" / ssd_files.SLOT_FILE_NAME) == 5 * 4096  # grown by the first store
    assert os.path.getsize(tmp_path / "nvme1" / ssd_files.SLOT_FILE_NAME) == 5 * 4096


def test_o_direct_is_used_where_the_filesystem_takes_it(tmp_path, open_tiers):
    tier = open_tiers(config(tmp_path, 8))
    assert tier.stats().o_direct is True
    assert all(fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT for f in tier._files.files)
    tier.store(chain(2))
    assert load_bytes(tier, hashes(chain(2)))[0] == 2
    buffered = open_tiers(config(tmp_path / "b", 8, o_direct=False))
    assert buffered.stats().o_direct is False
    assert not any(fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT for f in buffered._files.files)


def test_a_filesystem_refusing_o_direct_falls_back_to_buffered_logged_once(tmp_path, open_tiers, monkeypatch, caplog):
    """open(O_DIRECT) failing with EINVAL (as on some filesystems): buffered I/O, one log line per file."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(ssd_files.os, "open", refusing_open)
    with caplog.at_level(logging.WARNING, logger="kvtierd.t2.ssd_files"):
        tier = open_tiers(config(tmp_path, 8, num_dirs=2))
        items = chain(6)
        assert tier.store(items) == 6
        assert load_bytes(tier, hashes(items))[1] == [expected_bytes(h, 512) for h in hashes(items)]
    assert tier.stats().o_direct is False
    assert len([r for r in caplog.records if "O_DIRECT" in r.getMessage()]) == 2


def test_malformed_items_raise_and_change_nothing(tmp_path, open_tiers):
    tier = open_tiers(config(tmp_path, 8))
    good = chain(2)
    with pytest.raises(InvalidArgument):
        tier.store([good[0], (good[1][0], b"short")])
    with pytest.raises(InvalidArgument):
        tier.store([(good[0][0], torch.zeros(512, dtype=torch.float32))])
    with pytest.raises(InvalidArgument):
        tier.load(hashes(good), torch.zeros(2, 100, dtype=torch.uint8))
    assert tier.block_hashes() == [] and tier.stats().used_bytes == 0


def test_a_write_error_stops_admission_and_leaves_no_entry(tmp_path, monkeypatch):
    """EIO on a slot write: that store stores nothing, admission stops, earlier blocks still load,
    and after a restart the failed blocks are not there."""
    cfg = config(tmp_path, 16)
    tier = SsdTier.open(cfg, LAYOUT)
    old, new = chain(3), chain(3, start=10)
    tier.store(old)

    def failing_pwritev(*args):
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(ssd_files.os, "pwritev", failing_pwritev)
        assert tier.store(new) == 0
    stats = tier.stats()
    assert stats.admitting is False and "disk I/O error" in stats.reason and stats.num_io_errors == 1
    assert tier.store(chain(2, start=20)) == 0  # stays stopped, even though writes would work again
    assert tier.lookup(hashes(new)) == 0 and stats.used_bytes == 3 * 4096
    assert load_bytes(tier, hashes(old))[1] == [expected_bytes(h, 512) for h in hashes(old)]
    tier.close()
    tier = SsdTier.open(cfg, LAYOUT)
    assert sorted(tier.block_hashes()) == sorted(hashes(old)) and tier.admitting
    tier.close()


def test_an_index_commit_failure_leaves_no_entry(tmp_path, open_tiers, monkeypatch):
    import lmdb

    tier = open_tiers(config(tmp_path, 16))

    def full_disk_commit(*args, **kwargs):
        raise lmdb.DiskError("mdb_txn_commit: No space left on device")

    monkeypatch.setattr(tier._db, "commit", full_disk_commit)
    assert tier.store(chain(2)) == 0
    stats = tier.stats()
    assert stats.admitting is False and stats.reason.startswith("disk full") and stats.used_bytes == 0


def test_a_directory_serves_one_tier_at_a_time(tmp_path, open_tiers):
    cfg = config(tmp_path, 8)
    tier = open_tiers(cfg)
    with pytest.raises(FailedPrecondition, match=rf"^SSD tier directory: .* in use by another tier or process "
                                                 rf"\(pid {os.getpid()}\)"):
        SsdTier.open(cfg, LAYOUT)
    tier.close()
    tier.close()  # idempotent
    with pytest.raises(FailedPrecondition):
        tier.lookup(hashes(chain(1)))
    open_tiers(cfg).close()  # the lock went with the close


def test_o_direct_refused_at_io_time_falls_back_to_buffered(tmp_path, open_tiers, monkeypatch):
    """Some filesystems take O_DIRECT at open and refuse it at the first read (EINVAL): the probe
    at open catches it and the file goes buffered, before any block depends on it."""
    real_preadv = os.preadv

    def preadv_refusing_direct(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(ssd_files.os, "preadv", preadv_refusing_direct)
    tier = open_tiers(config(tmp_path, 8))
    assert tier.stats().o_direct is False
    items = chain(3)
    assert tier.store(items) == 3
    assert load_bytes(tier, hashes(items))[1] == [data for _, data in items]


def test_an_index_that_cannot_open_leaves_an_inert_tier_that_says_why(tmp_path, open_tiers):
    """No crash and no slot file touched: the tier holds nothing, admits nothing, and says why."""
    directory = tmp_path / "nvme0"
    directory.mkdir()
    (directory / "kvtierd-index.lmdb").write_bytes(b"not an lmdb directory")
    tier = open_tiers(config(tmp_path, 8))
    stats = tier.stats()
    assert stats.admitting is False and "index open" in stats.reason and stats.capacity_bytes == 0
    assert tier.store(chain(2)) == 0 and tier.lookup(hashes(chain(2))) == 0
    assert not (directory / ssd_files.SLOT_FILE_NAME).exists()
