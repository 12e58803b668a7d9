"""The SSD tier under failure: SIGKILL at random instants, flipped bits, truncated files, a full
disk, and many threads at once. In every case: a miss or the exact stored bytes, never others."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import threading
import time

import pytest
import torch

from kvtierd.t2.ssd_files import SLOT_FILE_NAME
from kvtierd.t2.ssd_tier import SsdTier, SsdTierConfig
from tests.t2 import ssd_crash_writer as writer
from tests.t2.ssd_crash_writer import CRASH_LAYOUT, FAT_INDEX_LAYOUT, crash_config, expected_bytes, expected_tokens
from tests.t2.test_ssd_tier import LAYOUT, ROOT, chain, config, hashes, load_bytes

NUM_KILLS = 24


@pytest.fixture(scope="module")
def fork_context():
    """Writers start from a fork server that imported kvtierd (and torch) once: a fresh child per
    kill in milliseconds instead of a 3-4 s interpreter start."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.t2.ssd_crash_writer"])
    return context


def complete_lines(path) -> list[tuple[str, list[bytes]]]:
    with open(path, "rb") as f:
        text = f.read().decode()
    lines = text.split("\n")[:-1]  # the last piece has no newline: incomplete or empty
    parts = (line.partition(" ") for line in lines)
    return [(verb, [bytes.fromhex(h) for h in rest.split()]) for verb, _, rest in parts]


def must_survive(lines) -> set[bytes]:
    """The last batch the writer saw stored, less anything it started removing afterwards."""
    last = max((i for i, (verb, _) in enumerate(lines) if verb == "stored"), default=None)
    if last is None:
        return set()
    removing = {h for verb, hs in lines[last + 1:] if verb == "removing" for h in hs}
    return set(lines[last][1]) - removing


def check_recovered(directory: str, lines) -> int:
    """Open after a kill: every index entry verifies and returns exactly its bytes."""
    tier = SsdTier.open(crash_config(directory), CRASH_LAYOUT)
    try:
        assert tier.stats().num_dropped_on_open == 0
        held = tier.block_hashes()
        out = torch.empty(1, CRASH_LAYOUT.bytes_per_block, dtype=torch.uint8)
        for block_hash in held:
            tokens = expected_tokens(block_hash, CRASH_LAYOUT.block_size)
            assert tier.lookup([block_hash], token_bytes=tokens, block_size=CRASH_LAYOUT.block_size) == 1
            assert tier.load([block_hash], out) == 1, "an index entry did not verify"
            assert bytes(out[0].numpy()) == expected_bytes(block_hash, out.shape[1]), "other bytes"
        assert tier.stats().num_corrupted_blocks == 0
        assert must_survive(lines) <= set(held), "a store that returned was lost"
        return len(held)
    finally:
        tier.close()


@pytest.mark.slow  # many killed writers
def test_sigkill_at_random_instants_leaves_only_verified_entries(tmp_path, fork_context):
    """A writer killed at 24 random instants (open, evict, write, sync, index commit, remove):
    after each, every index entry verifies and returns exactly the bytes stored for its hash,
    and the last store that returned is still there."""
    rng = random.Random(20240603)
    directory, log_path = str(tmp_path / "tier"), str(tmp_path / "writer.log")
    num_rounds_with_stores, num_held = 0, []
    for kill in range(NUM_KILLS):
        open(log_path, "w").close()
        process = fork_context.Process(target=writer.run_writer, args=(directory, kill, log_path))
        process.start()
        # one kill in four aims at the first 30 ms (start, open, recovery), the rest at the store loop
        time.sleep(rng.uniform(0.0, 0.03) if kill % 4 == 0 else rng.uniform(0.03, 0.45))
        process.kill()
        process.join(10)
        assert process.exitcode == -signal.SIGKILL, "the writer died on its own"
        lines = complete_lines(log_path)
        num_rounds_with_stores += any(verb == "stored" for verb, _ in lines)
        num_held.append(check_recovered(directory, lines))
    assert num_rounds_with_stores >= NUM_KILLS // 2, "most kills should land while the writer stores"
    assert max(num_held) >= writer.CRASH_CAPACITY_SLOTS // 2  # the tier did fill up and evict


def find_block(directories, data: bytes) -> tuple[str, int]:
    """Where a block's bytes lie in the slot files (found by content, not by the tier's word)."""
    for directory in directories:
        path = os.path.join(directory, SLOT_FILE_NAME)
        with open(path, "rb") as f:
            offset = f.read().find(data)
        if offset >= 0:
            return path, offset
    raise AssertionError("block bytes not found in any slot file")


@pytest.mark.parametrize("while_open", [True, False])
def test_flipped_bits_are_a_counted_miss_and_the_entry_goes(tmp_path, while_open):
    cfg = config(tmp_path, 16, num_dirs=2)
    items = chain(4)
    tier = SsdTier.open(cfg, LAYOUT)
    tier.store(items)
    path, offset = find_block(cfg.directories, items[1][1])
    if not while_open:
        tier.close()
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)[0]
        f.seek(offset + 100)
        f.write(bytes([byte ^ 0x10]))
    if not while_open:
        tier = SsdTier.open(cfg, LAYOUT)
    try:
        out = torch.full((4, 512), 7, dtype=torch.uint8)
        assert tier.load(hashes(items), out) == 1
        assert bytes(out[0].numpy()) == items[0][1]
        assert not out[1].any(), "the corrupt block's bytes must not be handed out"
        assert tier.stats().num_corrupted_blocks == 1
        assert hashes(items)[1] not in tier.block_hashes() and tier.lookup(hashes(items)) == 1
        assert load_bytes(tier, hashes(items)[2:])[1] == [data for _, data in items[2:]]
    finally:
        tier.close()
    tier = SsdTier.open(cfg, LAYOUT)  # the drop reached the persistent index
    assert sorted(tier.block_hashes()) == sorted(hashes(items)[:1] + hashes(items)[2:])
    tier.close()


@pytest.mark.parametrize("while_open", [True, False])
def test_a_truncated_slot_file_is_a_counted_miss(tmp_path, while_open):
    """Cut in the middle of block 2's slot: blocks 2 and 3 miss (a short read while open; past the
    files' end when opened again: dropped at open), are counted and dropped; blocks 0 and 1 still
    load."""
    cfg = config(tmp_path, 8)
    items = chain(4)
    tier = SsdTier.open(cfg, LAYOUT)
    tier.store(items)
    path, offset = find_block(cfg.directories, items[2][1])
    if not while_open:
        tier.close()
    os.truncate(path, offset + 256)
    if not while_open:
        tier = SsdTier.open(cfg, LAYOUT)
    try:
        num_loaded, loaded = load_bytes(tier, hashes(items))
        assert num_loaded == 2 and loaded == [data for _, data in items[:2]]
        assert load_bytes(tier, hashes(items)[3:])[0] == 0
        stats = tier.stats()
        assert (stats.num_corrupted_blocks if while_open else stats.num_dropped_on_open) == 2
        assert sorted(tier.block_hashes()) == sorted(hashes(items)[:2])
        assert tier.store(chain(2, start=40)) == 2  # the freed slots take new blocks again
        assert load_bytes(tier, hashes(chain(2, start=40)))[0] == 2
    finally:
        tier.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mountpoint)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); the RLIMIT_FSIZE test covers it")
    yield mountpoint
    subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def fill(directory) -> str:
    """Write a filler file until the filesystem says ENOSPC."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(64 << 10))
        except OSError:
            pass
    with open(path, "ab", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError:
            pass
    return path


def test_a_full_disk_stops_admission_and_keeps_serving(small_tmpfs):
    """A 2 MiB tmpfs asked for 8 MiB: the tier is bounded to what fits (and says so); once another
    writer fills the disk, a store that cannot index stores nothing, admission stops with a
    reason naming the disk, held blocks still load exactly, and the host tier keeps serving."""
    layout, nbytes = FAT_INDEX_LAYOUT, FAT_INDEX_LAYOUT.bytes_per_block
    cfg = SsdTierConfig([str(small_tmpfs)], capacity_bytes=8 << 20, lmdb_map_bytes=64 << 20)
    tier = SsdTier.open(cfg, layout)
    opened = tier.stats()
    assert 0 < opened.capacity_bytes < 2 << 20 and opened.admitting
    assert "disk" in opened.reason and "bounded" in opened.reason
    host_tier: dict[bytes, bytes] = {}  # stands for T1: the daemon writes through it first
    old = chain(8, layout=layout)
    host_tier.update((meta.block_hash, data) for meta, data in old)
    assert tier.store(old) == 8
    filler = fill(small_tmpfs)
    new = chain(32, start=100, layout=layout)
    host_tier.update((meta.block_hash, data) for meta, data in new)
    assert tier.store(new) == 0  # no exception into the caller
    stats = tier.stats()
    assert stats.admitting is False and stats.reason.startswith("disk full")
    assert tier.lookup(hashes(new)[:1]) == 0 and stats.num_cached_blocks == 8
    assert tier.store(chain(1, start=900, layout=layout)) == 0
    assert load_bytes(tier, hashes(old), nbytes) == (8, [data for _, data in old])
    assert all(host_tier[meta.block_hash] == data for meta, data in new)  # the other tier serves
    tier.close()
    os.unlink(filler)
    tier = SsdTier.open(cfg, layout)  # space again: admitting, old blocks still there
    try:
        assert tier.admitting and load_bytes(tier, hashes(old), nbytes)[0] == 8
        assert 8 * 4096 <= tier.stats().capacity_bytes <= opened.capacity_bytes  # its files count as its own
    finally:
        tier.close()


def test_a_file_size_cap_stops_admission_without_a_crash(tmp_path, fork_context):
    """RLIMIT_FSIZE below the capacity (SIGXFSZ ignored): the slot file gets what the cap allows,
    the index then hits the cap, admission stops naming the disk, and held blocks load exactly."""
    result_path = str(tmp_path / "result.json")
    process = fork_context.Process(target=writer.run_capped_writer,
                                   args=(str(tmp_path / "capped"), result_path, 1 << 20))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    with open(result_path) as f:
        result = json.load(f)
    assert result["opened"]["capacity_bytes"] == 1 << 20 and "disk" in result["opened"]["reason"]
    assert result["stats"]["admitting"] is False and "disk" in result["stats"]["reason"]
    assert result["num_held"] > 0 and result["exact"] is True
    assert result["refused_held"] == 0 and result["store_after_stop"] == 0


def test_many_threads_never_see_another_blocks_bytes(tmp_path):
    """Stores, loads and removes of 30 chains from 6 threads for 2 s over a small, constantly
    evicting tier: every load returns exactly its blocks' bytes (no slot used twice), nothing is
    corrupt."""
    nbytes = CRASH_LAYOUT.bytes_per_block
    cfg = SsdTierConfig([str(tmp_path / "a"), str(tmp_path / "b")], capacity_bytes=24 * 24576,
                        durability="none", high_watermark=0.9, low_watermark=0.6, lmdb_map_bytes=64 << 20)
    tier = SsdTier.open(cfg, CRASH_LAYOUT)
    chains = [chain(4, start=4 * i, layout=CRASH_LAYOUT) for i in range(30)]
    failures: list[str] = []
    num_loaded = [0]
    deadline = time.monotonic() + 2.0

    def work(seed: int) -> None:
        rng = random.Random(seed)
        out = torch.empty(4, nbytes, dtype=torch.uint8)
        try:
            while time.monotonic() < deadline:
                items = rng.choice(chains)
                roll = rng.random()
                if roll < 0.45:
                    tier.store(items[:rng.randint(1, 4)])
                elif roll < 0.9:
                    k = tier.load(hashes(items), out, parent=ROOT)
                    num_loaded[0] += k
                    for i in range(k):
                        if bytes(out[i].numpy()) != items[i][1]:
                            failures.append(f"wrong bytes for {items[i][0].block_hash.hex()}")
                else:
                    tier.remove(rng.sample(hashes(items), 2))
        except Exception as error:  # noqa: BLE001 - reported below
            failures.append(repr(error))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert failures == []
        stats = tier.stats()
        assert stats.num_corrupted_blocks == 0 and stats.num_evictions > 0 and num_loaded[0] > 0
        held = tier.block_hashes()
        assert [load_bytes(tier, [h], nbytes)[1] for h in held] == [[expected_bytes(h, nbytes)] for h in held]
    finally:
        tier.close()
