"""What a device pool caches: which block holds which hash (each hash's copies, oldest first), the
free queue of the blocks nobody holds, the prefix walk over the cached hashes, eviction and the
events of hashes that come and go. block_index.py builds the requests' block tables on it.

Eviction (which free block is reused next) is decided in eviction.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import FailedPrecondition, InvalidArgument
from kvtierd.index.classed_free_queue import ClassedFreeQueue
from kvtierd.index.distinct_keys import DistinctKeys
from kvtierd.index.eviction import EvictionHook, Evictor
from kvtierd.index.hash_to_blocks import HashToBlocks
from kvtierd.index.index_events import AllBlocksCleared, BlockStored, Doorbell, EventQueue, IndexEvent
from kvtierd.index.index_metrics import IndexObserver
from kvtierd.index.kv_block import KVBlock
from kvtierd.index.prefix_match import check_hashes, match_prefix, pack_prompt_tokens
from kvtierd.index.residency import LeaveReason, Residency
from kvtierd.retention.tier_retention import TierRetention
from kvtierd.token_bytes import PackableTokenIds, TokenBytes


class BlockCache:
    """The blocks of one device pool, the hashes they hold and their free queue; BlockIndex adds who
    holds them.

    Hits agree with vLLM's prefix cache (vllm/v1/core/block_pool.py), request by request against its
    KVCacheManager (tests/connectors/vllm/on_vllm/test_index_matches_vllm_prefix_cache.py):
    several blocks may hold one hash (`hash_to_blocks`: a prompt's last block is recomputed even
    when cached, and that copy is committed too); a hit takes the oldest copy; a copy leaves when
    its block is reused, and the next copy serves the hits. What the tiers see of copies:
    - the eviction hook sees a victim only when the last copy of its hash leaves T0: while a copy
      stays, T0 still serves the hash and copying it down would spend T1 slots and bandwidth on
      bytes that are still one hit away;
    - BlockStored is queued when the first copy of a hash is committed, BlockRemoved when its last
      copy leaves: per hash, strictly alternating, so a router keeping a set stays right (vLLM
      queues both per copy, and a consumer of its events has to count copies);
    - `cached_hashes()` and `num_cached_blocks` count distinct hashes (what a lookup can find,
      comparable with T1 and T2); `num_duplicate_blocks` counts the other copies; `num_evictions`
      counts blocks (each copy whose content was dropped for reuse);
    - `evict(hashes)` drops every copy nobody holds and counts the hashes that left.
    Every public method takes `_lock`; the methods with a leading underscore run under it. The
    attributes `blocks`, `free_queue`, `hash_to_blocks` and `hash_to_block` (each hash → the copy
    a hit takes, read-only) are for inspection.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        hash_size: int = 32,
        root: DaemonKey | None = None,
        on_evict: EvictionHook | None = None,
        observer: IndexObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_pending_events: int = 0,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise InvalidArgument(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_size = hash_size
        self.root = root  # when set, block 0 of every chain must name it as its parent
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = ClassedFreeQueue(self.blocks)
        self.hash_to_blocks = HashToBlocks()
        self.hash_to_block: Mapping[DaemonKey, KVBlock] = MappingProxyType(self.hash_to_blocks.first)
        self._observer = observer
        self._clock = clock
        self._events = EventQueue(max_pending_events) if max_pending_events else None
        self._evictor = Evictor(self.free_queue, self.hash_to_blocks, on_evict, observer, self._events)
        self._pop_free = self._evictor.pop_free
        self.distinct_keys = DistinctKeys()  # every hash ever committed here, counted once (under `_lock`)
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------- queries

    @property
    def on_evict(self) -> EvictionHook | None:
        """The eviction hook; set once, before use: the tier manager offloads through it."""
        return self._evictor.on_evict

    @on_evict.setter
    def on_evict(self, hook: EvictionHook | None) -> None:
        self._evictor.on_evict = hook

    @property
    def num_evictions(self) -> int:
        """Blocks whose hash was dropped to reuse them (each copy counts)."""
        return self._evictor.num_evictions

    @property
    def residency(self) -> Residency:
        """How long blocks stayed committed, by why they left (index/residency.py)."""
        return self._evictor.residency

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_dropped_events(self) -> int:
        return self._events.num_dropped if self._events is not None else 0

    @property
    def num_cached_blocks(self) -> int:
        """Distinct hashes cached here (held or not); their other copies are not counted."""
        return len(self.hash_to_blocks)

    @property
    def num_duplicate_blocks(self) -> int:
        """Blocks holding a hash that an older block holds too."""
        return self.hash_to_blocks.num_duplicate_blocks

    def lookup(self, block_hashes: Sequence[DaemonKey], token_ids: PackableTokenIds | None = None) -> int:
        """How many leading blocks of the chain are cached here. Changes nothing."""
        with self._lock:
            return len(self._hits(block_hashes, token_ids))

    # ----------------------------------------------------------------------------- cached content

    def cached_hashes(self) -> list[DaemonKey]:
        """A snapshot of every hash cached in this tier (held or not), each once."""
        with self._lock:
            return list(self.hash_to_blocks)

    def evict(self, block_hashes: Sequence[DaemonKey], copy_down: bool = True) -> int:
        """Drop every copy of the named hashes that nobody holds (ref_cnt 0) from this tier; the
        blocks move to the head of the free queue, empty (the eviction hook copies them down
        first unless `copy_down` is false). Copies in use are skipped and keep their hash.
        Returns how many of the hashes left the tier (no copy of them remains)."""
        with self._lock:
            now = self._clock()
            num_evicted = 0
            for block_hash in dict.fromkeys(block_hashes):
                copies = [block for block in self.hash_to_blocks.copies(block_hash) if block.ref_cnt == 0]
                if copies:
                    num_evicted += self._evictor.evict_free(copies, now, copy_down)
            return num_evicted

    def set_eviction(self, name: str) -> None:
        """Class NONE's cached blocks leave in the order called `name` ("lru" | "s3fifo":
        eviction_order.py); set once, before use."""
        with self._lock:
            self.free_queue.set_eviction(name)

    def set_retention(self, retention: TierRetention) -> None:
        """Evict by retention class, then LRU (classed_free_queue.py); set once, before any hint."""
        with self._lock:
            self.free_queue.set_retention(retention)

    def reclassify(self, block_hashes: Sequence[DaemonKey]) -> None:
        """The retention hints of these hashes (a chain, head first) changed (a HintTable listener):
        their free copies move to their class (ClassedFreeQueue.reclassify: the chain's tail leaves it first)."""
        with self._lock:
            copies = self.hash_to_blocks.copies
            self.free_queue.reclassify([block for block_hash in block_hashes for block in copies(block_hash)])

    def reset(self) -> bool:
        """Forget every cached block. Refused (False, nothing changed) while any block is in use."""
        with self._lock:
            if self.free_queue.num_free_blocks != self.num_blocks:
                return False
            self.free_queue.declassify_all()
            now, left = self._clock(), self._evictor.residency.left
            for block in self.hash_to_blocks.all_blocks():
                assert block.block_hash is not None, "a block in the table holds its hash"
                left(block.block_hash, now - block.committed_at_s, LeaveReason.FLUSHED)
                block.forget_content()
            self.hash_to_blocks.clear()
            if self._events is not None:
                self._events.put(AllBlocksCleared())
            return True

    def take_events(self) -> list[IndexEvent]:
        """Every event since the last call, atomically; empty unless events were enabled."""
        with self._lock:
            return self._events.take() if self._events is not None else []

    def set_event_doorbell(self, doorbell: Doorbell) -> None:
        """Ring `doorbell` whenever events wait to be taken (EventQueue); nothing unless events are on."""
        with self._lock:
            if self._events is not None:
                self._events.set_doorbell(doorbell)

    # ----------------------------------------------------------------------------- internals

    def _store(self, blocks: Sequence[KVBlock], block_hashes: Sequence[DaemonKey], parents: Sequence[DaemonKey],
               block_tokens: Sequence[TokenBytes], now: float) -> int:
        """Give each block its hash, parent and tokens: it becomes the newest copy of the hash (its
        first when no other block holds it), and BlockStored is queued for each hash that became
        cached. A block already holding its hash stays as it is; one holding another hash undoes
        this call's and raises. Returns how many of the blocks hold their hash afterwards."""
        setdefault = self.hash_to_blocks.first.setdefault
        stored: list[KVBlock] = []
        num_already_held = 0
        for block, block_hash, parent, tokens in zip(blocks, block_hashes, parents, block_tokens):
            held = block.block_hash
            if held is None:
                block.block_hash = block_hash
                block.parent_hash = parent
                block.token_ids = tokens
                block.committed_at_s = now
                stored.append(block)
                if setdefault(block_hash, block) is not block:  # an older block holds it
                    self.hash_to_blocks.add_copy(block_hash, block)  # this one is the newest copy
            elif held == block_hash:
                num_already_held += 1
            else:
                self._uncommit(stored)  # all or nothing
                raise FailedPrecondition(f"block {block.block_id} is already committed under another hash")
        for block_hash in block_hashes:
            self.distinct_keys.add(block_hash)
        if self._events is not None:
            first = self.hash_to_blocks.first
            for block in stored:
                block_hash = block.block_hash
                assert block_hash is not None, "committed above"
                if first[block_hash] is block:  # the first copy: the hash became cached here
                    self._events.put(BlockStored(block_hash, block.parent_hash, block.block_id, block.token_ids))
        return num_already_held + len(stored)

    def _uncommit(self, blocks: list[KVBlock]) -> None:
        """Undo the commits of this call before it raises, newest first."""
        for block in reversed(blocks):
            self.hash_to_blocks.remove(block)
            block.forget_content()

    def _hits(self, block_hashes: Sequence[DaemonKey], token_ids: PackableTokenIds | None) -> list[KVBlock]:
        check_hashes(block_hashes, self.hash_size)
        token_bytes = pack_prompt_tokens(token_ids, len(block_hashes), self.block_size)
        return match_prefix(self.hash_to_blocks.first, block_hashes, token_bytes, self.root, self.block_size)
