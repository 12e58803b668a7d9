"""Eviction write-back off the index lock: the hook only plans, a mover copies; the victim block
is not written before its bytes have landed in T1, and nobody sees its T1 entry half-written."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtierd.launch.daemon_process import wait_until
from kvtierd.tiering.block_io import PutBlock
from kvtierd.tiering.write_backs import WriteBacks
from kvtierd.token_bytes import pack_token_ids
from tests.factories import BLOCK_SIZE, NAMESPACE, tokens
from tests.tiering.tier_factories import content_for, make_manager, prefill, promote_exactly

PROMPT = tokens(100, 8 * BLOCK_SIZE)  # fills the 8-block pool
CHAIN = NAMESPACE.hash_blocks(PROMPT)


def test_when_landed_is_none_unless_a_write_back_is_in_flight():
    write_backs = WriteBacks()
    assert write_backs.when_landed([1, 2]) is None
    in_flight = write_backs.begin([1, 2])
    assert write_backs.when_landed([3]) is None
    landed = write_backs.when_landed([2, 3])
    assert not landed.done()
    write_backs.end(in_flight)
    assert landed.done() and write_backs.num_in_flight == 0


def test_a_block_evicted_twice_is_writable_after_both_write_backs():
    write_backs = WriteBacks()
    first, second = write_backs.begin([5]), write_backs.begin([5])
    landed = write_backs.when_landed([5])
    write_backs.end(first)
    assert not landed.done()
    write_backs.end(second)
    assert landed.done()


def test_a_cancelled_waiter_harms_nobody():
    write_backs = WriteBacks()
    in_flight = write_backs.begin([1])
    cancelled, waiting = write_backs.when_landed([1]), write_backs.when_landed([1])
    assert cancelled.cancel()
    write_backs.end(in_flight)
    assert waiting.done() and waiting.exception() is None


class HeldCopies:
    """The host codec's encode (T0 → T1) waits until `release()`: a copy held in flight."""

    def __init__(self, manager, monkeypatch) -> None:
        self.started, self._go = threading.Event(), threading.Event()
        codec = manager.tiers.host.codec
        encode = codec.encode

        def held_encode(*args):
            self.started.set()
            assert self._go.wait(10), "the held copy was never released"
            encode(*args)

        monkeypatch.setattr(codec, "encode", held_encode)

    def release(self) -> None:
        self._go.set()


@pytest.fixture
def manager():
    manager = make_manager()
    yield manager
    manager.close()


def test_an_evicting_acquire_returns_before_the_copy_and_the_index_stays_free(manager, monkeypatch):
    """The hook does not wait for its copy under the index lock: acquire returns, and lookups
    (which take that lock) answer, while the victims' D2H copy is still held in flight."""
    prefill(manager, "a", PROMPT)
    manager.release("a")
    held = HeldCopies(manager, monkeypatch)
    acquisition = manager.acquire("b", [], num_extra_blocks=8)  # evicts all 8 cached blocks
    assert held.started.wait(10)
    assert acquisition.writable is not None and not acquisition.writable.done()
    assert not acquisition.ticket.done()  # a caller that waits on the ticket may write after it
    assert manager.index.lookup(CHAIN) == 0  # answered while the copy is in flight
    assert manager.tiers.host.index.lookup(CHAIN) == 0  # the T1 entries are STORING: invisible
    held.release()
    acquisition.writable.result(10)
    assert acquisition.ticket.wait(10) == 0
    manager.drain()
    assert manager.tiers.host.index.lookup(CHAIN) == 8
    manager.release("b")


def test_a_victim_is_not_written_before_its_bytes_landed(manager, monkeypatch):
    """A Put into blocks just evicted waits for their write-back before it writes one byte; T1
    then holds the old bytes, exactly, and T0 the new ones."""
    prefill(manager, "a", PROMPT)
    manager.release("a")
    held = HeldCopies(manager, monkeypatch)
    writes = []
    write_block = manager.device_pool.write_block
    monkeypatch.setattr(manager.device_pool, "write_block", lambda *args: (writes.append(args[0]), write_block(*args)))
    other = tokens(5000, 8 * BLOCK_SIZE)
    other_chain = NAMESPACE.hash_blocks(other)
    blocks = [PutBlock(h, pack_token_ids(other[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]), block_view(h))
              for i, h in enumerate(other_chain)]
    put = manager.start_put("put", NAMESPACE.root)
    writer = threading.Thread(target=put.write, args=(blocks,))
    writer.start()
    assert wait_until(lambda: manager.tiers.write_backs.num_waiting or writes)
    assert writes == [] and manager.tiers.write_backs.num_in_flight == 8  # waiting, not writing over the victims
    held.release()
    writer.join(10)
    assert len(writes) == 8
    put.commit()
    put.close()
    manager.drain()
    assert manager.lookup(other_chain, other).t0 == 8
    manager.index.evict(other_chain)  # room for the promotion of PROMPT
    manager.drain()
    promote_exactly(manager, "check", PROMPT)  # T1 has PROMPT's bytes, not the Put's
    manager.release("check")


def block_view(block_hash: bytes) -> memoryview:
    return memoryview(content_for(block_hash).contiguous().view(-1).view(torch.uint8).numpy())
