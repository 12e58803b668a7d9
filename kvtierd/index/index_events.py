"""Events of the block indexes, for prefix-aware routers: what became cached and what left.

One pair per hash, not per copy: BlockStored when the first block holding a hash is committed,
BlockRemoved when the last one leaves, so a router that keeps a set of hashes stays exact. The
device tier's BlockIndex queues them; a lower tier's SlotIndex does too once its events are
enabled (only while the KV event publisher is on), with the slot in `block_id`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from kvtierd.daemon_key import DaemonKey
from kvtierd.token_bytes import TokenBytes


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """`block_hash` became cached in the tier: its first copy, in block (or slot) `block_id`."""

    block_hash: DaemonKey  # a block key, as the index holds it (BlockMeta)
    parent_hash: DaemonKey | None
    block_id: int
    token_ids: TokenBytes | None = None  # the block's tokens (what routers hash)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The tier no longer holds `block_hash`: its last copy was evicted or dropped."""

    block_hash: DaemonKey


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole device tier was reset."""


IndexEvent = BlockStored | BlockRemoved | AllBlocksCleared

# Rung when an event queue goes from empty to not empty, under the index's lock, on whichever thread
# queued the event: it must not block (the event feed's schedules a wake-up of its pump).
Doorbell = Callable[[], None]


class EventQueue:
    """Pending events, oldest first, bounded: when full the oldest is dropped and counted. The
    doorbell, when set, is rung each time the queue goes from empty to not empty, and at once when
    set on a queue that holds events: a consumer that takes every event after each ring misses none.

    Not thread-safe on its own: the block index holds its lock around every call.
    """

    def __init__(self, max_pending: int, doorbell: Doorbell | None = None) -> None:
        assert max_pending > 0
        self._pending: collections.deque[IndexEvent] = collections.deque(maxlen=max_pending)
        self.num_dropped = 0
        self._doorbell = doorbell

    def set_doorbell(self, doorbell: Doorbell) -> None:
        self._doorbell = doorbell
        if self._pending:
            doorbell()

    def put(self, event: IndexEvent) -> None:
        was_empty = not self._pending
        if len(self._pending) == self._pending.maxlen:
            self.num_dropped += 1
        self._pending.append(event)
        if was_empty and self._doorbell is not None:
            self._doorbell()

    def take(self) -> list[IndexEvent]:
        """Every pending event; the queue is empty afterwards."""
        events = list(self._pending)
        self._pending.clear()
        return events
