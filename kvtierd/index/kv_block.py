"""Per-block metadata of the device pool: identity, content key, reference count, LRU links."""

from __future__ import annotations

import dataclasses
import enum

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.slot_entry import BlockMeta
from kvtierd.retention.hint import Priority
from kvtierd.token_bytes import TokenBytes


class BlockState(enum.Enum):
    """The four states of a block; `ref_cnt` and `block_hash` are independent."""

    IN_USE_SHAREABLE = "in use, shareable"  # ref_cnt > 0, hash
    BEING_WRITTEN = "being written"  # ref_cnt > 0, no hash
    CACHED = "cached, evictable"  # ref_cnt == 0, hash, on the free queue
    EMPTY = "empty"  # ref_cnt == 0, no hash, on the free queue


@dataclasses.dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block of the device pool.

    Mutated only by the block index (BlockIndex and its Evictor) under its lock, and the
    free-queue links only by FreeBlockQueue.
    Free does not mean cleared: a block with ref_cnt 0 keeps its content and hash until it is
    popped from the free queue for reuse.
    """

    block_id: int
    block_hash: DaemonKey | None = None  # its key (BlockMeta's): none while it is written or empty
    parent_hash: DaemonKey | None = None  # the chain's previous hash, kept for verification
    token_ids: TokenBytes | None = None  # its tokens, kept for verification
    ref_cnt: int = 0
    committed_at_s: float = 0.0  # when the block got its hash
    released_at_s: float = 0.0  # when ref_cnt last fell to 0 (free): read for reuse gaps and idle times
    retention_class: Priority = Priority.NONE  # the free queue it is on (ClassedFreeQueue); NONE off it
    prev_free: KVBlock | None = dataclasses.field(default=None, repr=False)
    next_free: KVBlock | None = dataclasses.field(default=None, repr=False)

    @property
    def state(self) -> BlockState:
        if self.ref_cnt > 0:
            return BlockState.IN_USE_SHAREABLE if self.block_hash is not None else BlockState.BEING_WRITTEN
        return BlockState.CACHED if self.block_hash is not None else BlockState.EMPTY

    def meta(self) -> BlockMeta:
        """What a lower tier keeps of this committed block: its hash, parent and tokens."""
        assert self.block_hash is not None and self.parent_hash is not None and self.token_ids is not None, \
            f"block {self.block_id} is not committed"
        return BlockMeta(self.block_hash, self.parent_hash, self.token_ids)

    @property
    def is_queued(self) -> bool:
        """On the free queue (both links set: the queue has sentinels at both ends)."""
        return self.prev_free is not None

    def forget_content(self) -> None:
        """Drop the content key (eviction or reset); the caller updates the prefix table."""
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = None
