"""Many threads storing, loading and evicting at once for a bounded time: no slot is ever used
by two blocks (checked by content), no block leaks."""

from __future__ import annotations

import random
import threading
import time

import torch

from kvtierd.errors import ResourceExhausted
from kvtierd.tiering.tier_config import EdgePolicy
from tests.factories import BLOCK_SIZE, tokens
from tests.tiering.tier_factories import content_for, make_manager, prefill

PROMPTS = [tokens(1000 * (i + 1), 4 * BLOCK_SIZE) for i in range(20)]  # 80 blocks: more than T0 + T1
RUN_SECONDS = 3.0


def worker(manager, seed: int, deadline: float, errors: list, counts: list) -> None:
    rng = random.Random(seed)
    n = 0
    while time.monotonic() < deadline:
        prompt = rng.choice(PROMPTS)
        request = (seed, n)
        n += 1
        try:
            acquisition, num_ready, chain = prefill(manager, request, prompt)
        except ResourceExhausted:
            time.sleep(0.001)
            continue
        try:
            for block_id, block_hash in zip(acquisition.block_ids[:num_ready], chain):
                if not torch.equal(manager.device_pool.tensor[block_id], content_for(block_hash)):
                    errors.append(f"request {request}: block {block_id} does not hold {block_hash.hex()[:8]}")
        finally:
            manager.release(request)
        counts.append(num_ready)


def run_threads(manager, num_threads: int = 4) -> list[int]:
    errors: list[str] = []
    counts: list[int] = []
    deadline = time.monotonic() + RUN_SECONDS
    threads = [threading.Thread(target=worker, args=(manager, seed, deadline, errors, counts))
               for seed in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    manager.drain()
    assert errors == []
    return counts


def check_every_slot_holds_its_own_block(manager) -> None:
    entries = manager.tiers.host.index.entries()
    assert len({e.slot for e in entries}) == len(entries)
    for entry in entries:
        row = manager.tiers.host.slots[entry.slot].view(torch.float16).view(content_for(entry.block_hash).shape)
        assert torch.equal(row, content_for(entry.block_hash)), entry.slot
    for block_hash, block in manager.index.hash_to_block.items():
        assert torch.equal(manager.device_pool.tensor[block.block_id], content_for(block_hash))


def test_concurrent_requests_on_evict():
    manager = make_manager(num_device_blocks=24, host_blocks=32)
    try:
        counts = run_threads(manager)
        assert len(counts) > 50 and any(counts)  # traffic happened, and some of it hit
        check_every_slot_holds_its_own_block(manager)
        assert manager.index.num_free_blocks == 24 and manager.index.tables == {}
        stats = manager.stats()
        assert stats.t1.num_hit_blocks > 0 and stats.t1.num_evictions > 0
    finally:
        manager.close()


def test_concurrent_requests_write_through():
    manager = make_manager(num_device_blocks=24, host_blocks=32, t0_to_t1=EdgePolicy.WRITE_THROUGH)
    try:
        run_threads(manager)
        check_every_slot_holds_its_own_block(manager)
        assert manager.index.num_free_blocks == 24 and manager.index.tables == {}
    finally:
        manager.close()
