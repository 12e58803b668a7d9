"""An SSD tier giving disk back to another layout: its least recently used blocks go wherever they
lie, the kept ones move out of the end of its files (read verified, written, synced, then indexed),
the files are truncated, and a crash at any step leaves only records that name their own bytes."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import threading

import pytest
import torch

from kvtierd.t2.node_budget import NodeBudget
from kvtierd.t2.ssd_files import SLOT_FILE_NAME
from kvtierd.t2.ssd_tier import SsdTier
from tests.t2 import ssd_crash_writer as writer
from tests.t2.ssd_crash_writer import (
    CRASH_LAYOUT,
    CRASH_STRIDE,
    GIVE_BACK_CRASH_POINTS,
    GIVE_BACK_HASHES,
    GIVE_BACK_KEPT,
    GIVE_BACK_SLOTS,
    expected_bytes,
    filled_for_give_back,
    give_back_config,
)
from tests.t2.test_ssd_reliability import complete_lines, find_block

NBYTES = CRASH_LAYOUT.bytes_per_block  # 23,040 bytes in a 24 KiB slot: moves go through the staging buffers


@pytest.fixture(scope="module")
def fork_context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.t2.ssd_crash_writer"])
    return context


def file_slots(directory: str, name: str) -> int:
    paths = [os.path.join(directory, name, str(i), SLOT_FILE_NAME) for i in range(2)]
    return sum(os.path.getsize(path) for path in paths) // CRASH_STRIDE


def exact(tier: SsdTier, block_hashes: list[bytes]) -> bool:
    out = torch.empty(1, NBYTES, dtype=torch.uint8)
    return all(tier.load([h], out) == 1 and bytes(out[0].numpy()) == expected_bytes(h, NBYTES) for h in block_hashes)


def reopened(directory: str) -> SsdTier:
    """Tier A opened alone on its directory, as a restarted daemon would."""
    return SsdTier.open(give_back_config(directory, "a", None), CRASH_LAYOUT)


@pytest.mark.parametrize("durability", ["fdatasync", "none"])
def test_the_most_recently_used_blocks_are_kept_and_a_block_that_fails_to_verify_is_dropped(tmp_path, durability):
    """A gives back half its disk: 4-11 (least recently used) go, 0-3 stay, 12-15 move into 4-7 exactly
    except 13, whose bytes were flipped on disk (dropped, counted); the files hold 8 slots; after a
    restart the same 7 blocks come back exactly."""
    directory = str(tmp_path)
    budget = NodeBudget(GIVE_BACK_SLOTS * CRASH_STRIDE, "ssd")
    a = filled_for_give_back(directory, budget, durability)
    path, offset = find_block([os.path.dirname(f.path) for f in a._files.files],
                              expected_bytes(GIVE_BACK_HASHES[13], NBYTES))
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        f.write(b"\xff\x00\xff")
    b = writer.ask_for_disk(directory, budget)
    kept = [h for h in GIVE_BACK_KEPT if h != GIVE_BACK_HASHES[13]]
    try:
        assert file_slots(directory, "a") == a.stats().file_bytes // CRASH_STRIDE == 8
        assert budget.held_bytes(a._budget_key) == 8 * CRASH_STRIDE and b.stats().num_cached_blocks == 4
        assert sorted(a.block_hashes()) == sorted(kept)
        assert exact(a, kept) and a.stats().num_corrupted_blocks == 1
        assert a.admitting
        a.close()
        a = reopened(directory)
        assert a.stats().num_recovered_blocks == 7 and a.stats().num_dropped_on_open == 0
        assert sorted(a.block_hashes()) == sorted(kept) and exact(a, kept)
        assert a.stats().num_corrupted_blocks == 0
    finally:
        a.close()
        b.close()


def test_a_failed_write_of_the_moves_drops_the_moved_blocks_and_stops_admission(tmp_path):
    """The disk fails the moved blocks' writes: 12-15 are dropped (their old slots are truncated
    away), 0-3 stay exact, T2 stops admitting, and a restart finds exactly 0-3."""
    directory = str(tmp_path)
    budget = NodeBudget(GIVE_BACK_SLOTS * CRASH_STRIDE, "ssd")
    a = filled_for_give_back(directory, budget)

    def failing_write_run(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    a._files.write_run = failing_write_run  # type: ignore[method-assign]
    b = writer.ask_for_disk(directory, budget)
    try:
        assert file_slots(directory, "a") == 8
        assert sorted(a.block_hashes()) == sorted(GIVE_BACK_HASHES[:4]) and exact(a, GIVE_BACK_HASHES[:4])
        assert not a.admitting and "give back disk" in a.stats().reason
        a.close()
        a = reopened(directory)
        assert sorted(a.block_hashes()) == sorted(GIVE_BACK_HASHES[:4]) and exact(a, GIVE_BACK_HASHES[:4])
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("crash_at", GIVE_BACK_CRASH_POINTS)
def test_a_crash_at_any_step_of_a_give_back_leaves_the_kept_blocks_exact(tmp_path, fork_context, crash_at):
    """Killed after the evicted records' commit, amid the moved blocks' writes, before the moved
    records' commit, before or after the truncation: on reopening, the index holds exactly the 8
    kept blocks, each verifying and reading exactly (none corrupt, none dropped on open)."""
    directory, log_path = str(tmp_path / "tiers"), str(tmp_path / "crash.log")
    process = fork_context.Process(target=writer.run_give_back, args=(directory, crash_at, log_path))
    process.start()
    process.join(60)
    assert process.exitcode == -signal.SIGKILL and complete_lines(log_path) == [(crash_at, [])]
    a = reopened(directory)
    try:
        assert a.stats().num_dropped_on_open == 0
        assert sorted(a.block_hashes()) == sorted(GIVE_BACK_KEPT)
        assert exact(a, GIVE_BACK_KEPT) and a.stats().num_corrupted_blocks == 0
    finally:
        a.close()


def test_a_store_while_a_give_back_moves_blocks_reuses_slots_and_never_grows_over_them(tmp_path):
    """A (16 slots, the most it may hold) gives back 4 of a 24-slot budget to B, which wants 12; while
    A's moves are in flight the budget has bytes free, yet a store into A recycles its least recently used slots
    (4-7: 8-11 went) instead of growing the files over the slots the moving blocks still occupy: afterwards
    A's files and index agree on 12 slots and every block it holds reads exactly."""
    directory = str(tmp_path)
    budget = NodeBudget(24 * CRASH_STRIDE, "ssd")
    a = filled_for_give_back(directory, budget)
    reached, gate = threading.Event(), threading.Event()
    mover = a._growth._mover
    move = mover.move

    def gated_move(moves):
        reached.set()
        assert gate.wait(30)
        return move(moves)

    mover.move = gated_move  # type: ignore[method-assign]
    asked: list[SsdTier] = []
    asking = threading.Thread(target=lambda: asked.append(writer.ask_for_disk(directory, budget, 12)))
    asking.start()
    try:
        assert reached.wait(30)
        new = [writer.block(bytes([0xa0 + i]) * 32, writer.ROOT, CRASH_LAYOUT) for i in range(4)]
        assert a.store(new) == 4
        gate.set()
        asking.join(30)
        assert asked and asked[0].stats().num_cached_blocks == 12
        held = GIVE_BACK_KEPT + [meta.block_hash for meta, _ in new]
        assert file_slots(directory, "a") == a.stats().file_bytes // CRASH_STRIDE == 12
        assert sorted(a.block_hashes()) == sorted(held) and exact(a, held)
        assert budget.used_bytes <= budget.capacity_bytes and a.stats().num_corrupted_blocks == 0
    finally:
        gate.set()
        asking.join(30)
        a.close()
        for tier in asked:
            tier.close()
