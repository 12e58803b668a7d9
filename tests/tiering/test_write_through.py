"""Write-through that writes: T0 → T1 → T2 drops no block in silence. A T1 entry whose T2 write is
pending is pinned, never evicted first; blocks that find no T1 slot wait for one (at most
policy.write_through_wait_s), and what waits longer is dropped and counted; a Put that finds T0
full of blocks on their way down waits for them. T2's disk answers when a test opens its gate."""

from __future__ import annotations

import threading

import pytest

from kvtierd.errors import ResourceExhausted
from kvtierd.launch.daemon_process import wait_until
from kvtierd.t2.ssd_files import SlotFiles
from kvtierd.t2.ssd_tier import SsdTier, SsdTierConfig
from kvtierd.tier import Edge
from kvtierd.tiering.tier_config import EdgePolicy
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.test_block_io import expected, get, put
from tests.tiering.tier_factories import make_manager, prefill

HOST_SLOTS = 4


@pytest.fixture
def disk_gate(monkeypatch):
    """T2's slot-file writes wait until the test sets this event: a disk that answers on cue."""
    gate = threading.Event()
    write_run = SlotFiles.write_run

    def gated(self, run, sources) -> None:
        assert gate.wait(60), "the test never opened the disk gate"
        write_run(self, run, sources)

    monkeypatch.setattr(SlotFiles, "write_run", gated)
    yield gate
    gate.set()


def write_through_manager(tmp_path, num_device_blocks: int = 16, **config):
    """T0 → T1 → T2 write-through over a T1 of HOST_SLOTS slots."""
    return make_manager(num_device_blocks, host_blocks=HOST_SLOTS, t0_to_t1=EdgePolicy.WRITE_THROUGH,
                        ssd_config=SsdTierConfig([str(tmp_path / "ssd")], capacity_bytes=64 * 4096), **config)


def dropped(manager, edge: Edge = Edge.T0_T1) -> int:
    return manager.stats().num_dropped_offload_blocks[edge]


def test_a_t1_entry_whose_t2_write_is_pending_is_not_evicted_and_the_next_chain_waits(tmp_path, disk_gate):
    """T1 holds chain A pinned while its T2 write waits on the disk; chain B finds no slot and
    waits instead of evicting A or being skipped; the disk answers: both are on T2, none dropped."""
    manager = write_through_manager(tmp_path)
    try:
        prompt_a, prompt_b = tokens(1, HOST_SLOTS * BLOCK_SIZE), tokens(2, HOST_SLOTS * BLOCK_SIZE)
        chain_a, chain_b = NAMESPACE.hash_blocks(prompt_a), NAMESPACE.hash_blocks(prompt_b)
        host = manager.tiers.host
        prefill(manager, "a", prompt_a)
        assert wait_until(lambda: host.index.lookup(chain_a) == HOST_SLOTS)  # in T1, its T2 write at the gate
        prefill(manager, "b", prompt_b)
        assert host.index.evict_lru(HOST_SLOTS) == []  # every entry pinned by its pending T2 write
        assert host.index.lookup(chain_a) == HOST_SLOTS and host.index.lookup(chain_b) == 0
        disk_gate.set()
        manager.drain()
        assert manager.tiers.ssd.lookup(chain_a) == HOST_SLOTS and manager.tiers.ssd.lookup(chain_b) == HOST_SLOTS
        assert dropped(manager) == dropped(manager, Edge.T1_T2) == 0
        manager.release("a")
        manager.release("b")
    finally:
        disk_gate.set()
        manager.close()


def test_a_commit_twice_as_large_as_t1_reaches_t2_whole(tmp_path):
    """8 blocks committed at once through a T1 of 4 slots: written down 4 at a time, all 8 on T2."""
    manager = write_through_manager(tmp_path)
    try:
        prompt = tokens(3, 2 * HOST_SLOTS * BLOCK_SIZE)
        chain = NAMESPACE.hash_blocks(prompt)
        prefill(manager, "a", prompt)
        manager.drain()
        assert manager.tiers.ssd.lookup(chain) == len(chain) == 2 * HOST_SLOTS
        assert manager.stats().num_offloaded_blocks[Edge.T1_T2] == len(chain) and dropped(manager) == 0
        manager.release("a")
    finally:
        manager.close()


@pytest.mark.parametrize("wait_s", [0.0, 0.2], ids=["no-wait", "short-wait"])
def test_blocks_that_wait_longer_than_the_bound_are_dropped_counted_and_t0_lets_go(tmp_path, disk_gate, wait_s):
    """The disk holds T1's 4 slots pinned: of 8 committed blocks 4 find no slot; once
    write_through_wait_s has passed they are counted as dropped on T0 → T1 and their T0 hold goes,
    while the 4 placed still reach T2 when the disk answers."""
    manager = write_through_manager(tmp_path, write_through_wait_s=wait_s)
    try:
        prompt = tokens(4, 2 * HOST_SLOTS * BLOCK_SIZE)
        chain = NAMESPACE.hash_blocks(prompt)
        prefill(manager, "a", prompt)
        manager.release("a")
        backlog = manager.offloader.backlog
        assert wait_until(lambda: dropped(manager) == HOST_SLOTS and backlog.num_held_blocks == 0, timeout_s=30)
        assert manager.index.num_free_blocks == manager.index.num_blocks  # T0 holds none of them any more
        disk_gate.set()
        manager.drain()
        assert manager.tiers.ssd.lookup(chain) == HOST_SLOTS and dropped(manager) == HOST_SLOTS
        assert dropped(manager, Edge.T1_T2) == 0
    finally:
        disk_gate.set()
        manager.close()


def test_a_put_into_a_t0_full_of_blocks_on_their_way_down_waits_for_them(tmp_path, disk_gate):
    """T0 of 8 blocks: chain A sits in T1, pinned while its T2 write waits on the disk (its T0
    blocks let go once copied); chains B and C hold all 8 T0 blocks waiting for T1; a fourth Put
    waits for T0 instead of failing, and once the disk answers all four chains reach T2 and read
    back exactly."""
    manager = write_through_manager(tmp_path, num_device_blocks=2 * HOST_SLOTS)
    try:
        prompts = [tokens(10 + i, HOST_SLOTS * BLOCK_SIZE) for i in range(4)]
        for i, prompt in enumerate(prompts[:3]):  # C may wait (briefly) for A's copy into T1 to land
            put(manager, prompt, f"put-{i}")
        backlog = manager.offloader.backlog
        assert backlog.num_held_blocks == 2 * HOST_SLOTS  # B and C
        outcome: list[object] = []
        fourth = threading.Thread(target=lambda: outcome.append(_put_or_error(manager, prompts[3])))
        fourth.start()
        assert wait_until(lambda: backlog.num_waiting == 1, timeout_s=30)  # it found T0 full and waits
        disk_gate.set()
        fourth.join(60)
        assert outcome and not isinstance(outcome[0], BaseException), outcome
        manager.drain()
        for prompt in prompts:
            chain = NAMESPACE.hash_blocks(prompt)
            assert manager.tiers.ssd.lookup(chain) == HOST_SLOTS
            assert get(manager, chain, prompt) == expected(chain)
        assert dropped(manager) == dropped(manager, Edge.T1_T2) == 0
    finally:
        disk_gate.set()
        manager.close()


def test_a_put_larger_than_t0_still_fails_at_once_when_nothing_is_on_its_way_down(tmp_path):
    """The wait is for blocks that will be let go: with no write-through in flight a Put that
    does not fit T0 is ResourceExhausted at once, as before."""
    manager = write_through_manager(tmp_path, num_device_blocks=2)
    try:
        with pytest.raises(ResourceExhausted):
            put(manager, tokens(20, 3 * BLOCK_SIZE))
        assert manager.offloader.backlog.num_waiting == 0
    finally:
        manager.close()


def _put_or_error(manager, prompt: list[int]) -> object:
    try:
        return put(manager, prompt, "put-d")
    except BaseException as error:  # reported to the test thread
        return error


def test_commits_made_while_a_t2_write_waits_on_the_disk_go_down_in_one_write(tmp_path, disk_gate, monkeypatch):
    """The first commit's T2 write waits at the disk; three more commits land in T1 meanwhile. Once the
    disk answers, their six blocks go to T2 in one store (one write, one sync, one index commit), not
    three; every block is on T2 and reads back exactly."""
    stores: list[int] = []
    store = SsdTier.store

    def counted(self, items):
        stores.append(len(items))
        return store(self, items)

    monkeypatch.setattr(SsdTier, "store", counted)
    manager = make_manager(32, host_blocks=32, t0_to_t1=EdgePolicy.WRITE_THROUGH,
                           ssd_config=SsdTierConfig([str(tmp_path / "ssd")], capacity_bytes=64 * 4096))
    try:
        prompts = [tokens(20 + i, 2 * BLOCK_SIZE) for i in range(4)]
        chains = [NAMESPACE.hash_blocks(prompt) for prompt in prompts]
        host = manager.tiers.host
        for i, prompt in enumerate(prompts):
            prefill(manager, f"r{i}", prompt)
            assert wait_until(lambda: host.index.lookup(chains[i]) == 2)  # in T1; the first's T2 write at the gate
        assert stores == [2]
        disk_gate.set()
        manager.drain()
        assert stores == [2, 6]
        for i, (prompt, chain) in enumerate(zip(prompts, chains)):
            assert manager.tiers.ssd.lookup(chain) == 2
            manager.release(f"r{i}")
            assert get(manager, chain, prompt) == expected(chain)
        assert dropped(manager) == dropped(manager, Edge.T1_T2) == 0
    finally:
        disk_gate.set()
        manager.close()
