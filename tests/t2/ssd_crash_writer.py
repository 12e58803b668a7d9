"""Processes for the SSD tier's reliability tests (run in a child process, killed or capped).

Block bytes and token ids are a function of the block hash (`expected_bytes`, `expected_tokens`),
so a checker that never saw the writer knows what every index entry must return.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import resource
import signal
import threading

import numpy as np
import torch

from kvtierd.index.slot_entry import BlockMeta
from kvtierd.layout import Layout
from kvtierd.t2.node_budget import NodeBudget
from kvtierd.t2.ssd_tier import SsdTier, SsdTierConfig

# 3 × 2 × 16 × 5 × 24 × 2 = 23,040 bytes a block: not a multiple of 4096, so slots are padded
# and O_DIRECT goes through the staging buffers.
CRASH_LAYOUT = Layout("crash-test", num_layers=3, num_kv_heads=5, head_dim=24, block_size=16)
CRASH_STRIDE = 24576
CRASH_CAPACITY_SLOTS = 40
ROOT = b"\x00" * 32

# 4 KiB blocks of 1,024 tokens: 4 KiB of token ids per index record, so the index grows fast.
FAT_INDEX_LAYOUT = Layout("disk-full-test", num_layers=1, num_kv_heads=1, head_dim=1, block_size=1024)


def expected_bytes(block_hash: bytes, nbytes: int) -> bytes:
    return np.random.default_rng(int.from_bytes(block_hash[:16], "little")).bytes(nbytes)


def expected_tokens(block_hash: bytes, block_size: int) -> bytes:
    return (block_hash * (4 * block_size // len(block_hash) + 1))[:4 * block_size]


def block(block_hash: bytes, parent: bytes, layout: Layout) -> tuple[BlockMeta, bytes]:
    meta = BlockMeta(block_hash, parent, expected_tokens(block_hash, layout.block_size))
    return meta, expected_bytes(block_hash, layout.bytes_per_block)


def crash_config(directory: str) -> SsdTierConfig:
    """Two slot files (striping), 40 slots, watermarks that evict every few batches."""
    return SsdTierConfig([os.path.join(directory, "a"), os.path.join(directory, "b")],
                         capacity_bytes=CRASH_CAPACITY_SLOTS * CRASH_STRIDE, num_io_threads=2,
                         high_watermark=0.9, low_watermark=0.7, lmdb_map_bytes=64 << 20)


def _log(fd: int, verb: str, hashes: list[bytes]) -> None:
    os.write(fd, f"{verb} {' '.join(h.hex() for h in hashes)}\n".encode())  # one write: whole or absent


def run_writer(directory: str, seed: int, log_path: str) -> None:
    """Store chains of random blocks (and now and then remove some) until killed. Logs `opened`
    once the tier is open, `removing ...` before a remove and `stored ...` after a store returns."""
    rng = random.Random(seed)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    tier = SsdTier.open(crash_config(directory), CRASH_LAYOUT)
    _log(log_fd, "opened", [])
    stored: list[bytes] = []
    while True:
        if stored and rng.random() < 0.15:
            victims = rng.sample(stored, min(len(stored), rng.randint(1, 3)))
            _log(log_fd, "removing", victims)
            tier.remove(victims)
        parent = rng.choice(stored[-8:]) if stored and rng.random() < 0.5 else ROOT
        items = []
        for _ in range(rng.randint(1, 6)):
            block_hash = rng.randbytes(32)
            items.append(block(block_hash, parent, CRASH_LAYOUT))
            parent = block_hash
        if tier.store(items) == len(items):
            hashes = [meta.block_hash for meta, _ in items]
            _log(log_fd, "stored", hashes)
            stored = (stored + hashes)[-64:]


def run_capped_writer(directory: str, result_path: str, max_file_bytes: int) -> None:
    """Under RLIMIT_FSIZE (SIGXFSZ ignored): open a tier asking for more than the cap, store until
    it stops admitting, check the blocks it holds, and report as JSON."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    config = SsdTierConfig([directory], capacity_bytes=4 * max_file_bytes, lmdb_map_bytes=64 << 20)
    tier = SsdTier.open(config, FAT_INDEX_LAYOUT)
    opened = tier.stats()
    stored, refused, num_attempts = [], [], 0
    while tier.admitting and num_attempts < 400:
        num_attempts += 1
        items = [block(os.urandom(32), ROOT, FAT_INDEX_LAYOUT) for _ in range(4)]
        if tier.store(items) == len(items):
            stored += [meta.block_hash for meta, _ in items]
        else:
            refused += [meta.block_hash for meta, _ in items]
    out = torch.empty(1, FAT_INDEX_LAYOUT.bytes_per_block, dtype=torch.uint8)
    held = tier.block_hashes()
    exact = all(tier.load([h], out) == 1 and bytes(out[0].numpy()) == expected_bytes(h, out.shape[1]) for h in held)
    result = dict(opened=dataclasses.asdict(opened), stats=dataclasses.asdict(tier.stats()), num_stored=len(stored),
                  num_held=len(held), exact=exact, refused_held=sum(tier.lookup([h]) for h in refused),
                  store_after_stop=tier.store([block(os.urandom(32), ROOT, FAT_INDEX_LAYOUT)]))
    tier.close()
    with open(result_path, "w") as f:
        json.dump(result, f)


# A give-back: tier A (two files) holds a chain of 16 blocks, block i in slot i, stored as 0-11 and then
# 12-15 (a later turn), and reads 0-3 again; B, under its share of a 16-slot budget, makes A evict its 8
# least recently used (4-11: they leave tail first) and move 12-15 into 4-7.
GIVE_BACK_SLOTS = 16
GIVE_BACK_HASHES = [i.to_bytes(4, "little") * 8 for i in range(GIVE_BACK_SLOTS)]
GIVE_BACK_KEPT = GIVE_BACK_HASHES[:4] + GIVE_BACK_HASHES[12:]
# where run_give_back kills itself: after the evicted records' commit, when the first of the two runs
# of moved blocks (one per file) is written and the second not, before the moved records' commit,
# before the truncation, after it
GIVE_BACK_CRASH_POINTS = ("evicted", "moving", "moved", "committed", "truncated")


def give_back_config(directory: str, name: str, budget: NodeBudget | None, durability: str = "fdatasync",
                     num_files: int = 2) -> SsdTierConfig:
    return SsdTierConfig([os.path.join(directory, name, str(i)) for i in range(num_files)],
                         capacity_bytes=GIVE_BACK_SLOTS * CRASH_STRIDE, durability=durability,
                         lmdb_map_bytes=16 << 20, node_budget=budget)


def filled_for_give_back(directory: str, budget: NodeBudget, durability: str = "fdatasync") -> SsdTier:
    """Tier A holding the 16-block chain, stored as 0-11 then 12-15, 0-3 read again last (the most
    recently used): from least recently used, 11 down to 4, 15 down to 12, 3 down to 0."""
    tier = SsdTier.open(give_back_config(directory, "a", budget, durability), CRASH_LAYOUT)
    items, parent = [], ROOT
    for block_hash in GIVE_BACK_HASHES:
        items.append(block(block_hash, parent, CRASH_LAYOUT))
        parent = block_hash
    assert tier.store(items[:12]) == 12 and tier.store(items[12:]) == GIVE_BACK_SLOTS - 12
    out = torch.empty(4, CRASH_LAYOUT.bytes_per_block, dtype=torch.uint8)
    assert tier.load(GIVE_BACK_HASHES[:4], out) == 4
    return tier


def ask_for_disk(directory: str, budget: NodeBudget, num_blocks: int = 4) -> SsdTier:
    """Tier B, opened on the budget, stores `num_blocks` blocks: under its share and finding too few
    bytes free, it makes A give back."""
    tier = SsdTier.open(give_back_config(directory, "b", budget, num_files=1), CRASH_LAYOUT)
    tier.store([block(os.urandom(32), ROOT, CRASH_LAYOUT) for _ in range(num_blocks)])
    return tier


def run_give_back(directory: str, crash_at: str, log_path: str) -> None:
    """Fill A, then let B ask for disk, killing this process at `crash_at` (logged just before)."""
    budget = NodeBudget(GIVE_BACK_SLOTS * CRASH_STRIDE, "ssd")
    tier = filled_for_give_back(directory, budget)
    db, files = tier._db, tier._files
    assert db is not None
    commit, write_run, resize = db.commit, files.write_run, files.resize
    num_commits = num_runs = 0
    one_run_at_a_time = threading.Lock()

    def crash(point: str) -> None:
        if point == crash_at:
            log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(log_fd, f"{point}\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)

    def crashing_commit(*args, **kwargs):
        nonlocal num_commits
        num_commits += 1
        if num_commits == 2:
            crash("moved")
        commit(*args, **kwargs)
        if num_commits == 1:
            crash("evicted")

    def crashing_write_run(*args, **kwargs):
        nonlocal num_runs
        with one_run_at_a_time:  # the first run lands whole, the second never starts
            if num_runs == 1:
                crash("moving")
            write_run(*args, **kwargs)
            num_runs += 1

    def crashing_resize(*args, **kwargs):
        crash("committed")
        resize(*args, **kwargs)
        crash("truncated")

    db.commit, files.write_run, files.resize = crashing_commit, crashing_write_run, crashing_resize
    ask_for_disk(directory, budget)
    os.write(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), b"no crash\n")
