"""The block index of a device pool: which block holds which content (block_cache.py), and who holds
which block: the requests' block tables, their allocation, commit, release, fork and copy-on-write.

Eviction (which free block is reused next) is decided in eviction.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvtierd.index.allocation import AllocatedBlocks, WriteTarget
from kvtierd.index.block_cache import BlockCache
from kvtierd.index.eviction import EvictionHook
from kvtierd.index.index_metrics import IndexObserver
from kvtierd.index.kv_block import KVBlock
from kvtierd.index.prefix_match import check_hashes
from kvtierd.index.query_counting import QueryCounting
from kvtierd.token_bytes import PackableTokenIds, pack_token_ids, packed_size, token_count, tokens_of_blocks

RequestId = Hashable
CopyBlock = Callable[[int, int], None]  # (src_block_id, dst_block_id): copy the bytes


class BlockIndex(BlockCache):
    """The block tables of the requests that hold a device pool's blocks, over its BlockCache (the
    blocks, the copies of each hash, the free queue). Lookup, allocate and can_allocate walk the
    oldest copies; prepare_write refuses every committed copy.

    Invariants (checked by tests/index/test_block_index_stateful.py after every step):
    - every block is in exactly one state of BlockState;
    - a block's ref_cnt equals the number of block-table entries that hold it;
    - a block is on the free queue iff its ref_cnt is 0; head = next victim;
    - a block carries a hash iff `hash_to_blocks` holds it as a copy of that hash;
      `hash_to_block[h]` is the oldest copy of `h`;
    - a request's blocks are freed tail first; those that hold no hash go to the head (reused
      first, as in vLLM), cached ones to the tail: the least recently released goes first, and
      the blocks nearest the start of a prompt, the most shared, are evicted last.
    Ref counts and block tables change together under `_lock`; every public method takes it.
    A call that raises has changed nothing: checks come before the first mutation.
    `tables` (request → its blocks) is for inspection, like BlockCache's attributes.
    """

    def __init__(self, num_blocks: int, block_size: int, *, copy_block: CopyBlock | None = None,
                 hash_size: int = 32, root: DaemonKey | None = None, on_evict: EvictionHook | None = None,
                 observer: IndexObserver | None = None, clock: Callable[[], float] = time.monotonic,
                 max_pending_events: int = 0) -> None:
        """`copy_block` copies a block for copy-on-write; the others are BlockCache's."""
        super().__init__(num_blocks, block_size, hash_size=hash_size, root=root, on_evict=on_evict,
                         observer=observer, clock=clock, max_pending_events=max_pending_events)
        self.tables: dict[RequestId, list[KVBlock]] = {}
        self._copy_block = copy_block

    # ----------------------------------------------------------------------------- queries

    def block_table(self, request_id: RequestId) -> list[int]:
        with self._lock:
            return [block.block_id for block in self._table(request_id)]

    def can_allocate(self, block_hashes: Sequence[DaemonKey], num_extra_blocks: int = 0,
                     token_ids: PackableTokenIds | None = None) -> bool:
        with self._lock:
            hits = self._hits(block_hashes, token_ids)
            num_new_blocks = len(block_hashes) - len(hits) + num_extra_blocks
            return self._num_blocks_short([block for block in hits if block.ref_cnt == 0], num_new_blocks) <= 0

    def count_query(self, num_tokens: int, num_hit_tokens: int = 0) -> None:
        """Tokens asked for that no walk of this index counted as a query (a Lookup's query, with
        the T0 hits it promised; Put's later batches, Get's misses): the observer's counts."""
        if self._observer is not None and num_tokens:
            self._observer.on_query(num_tokens, num_hit_tokens)

    # ----------------------------------------------------------------------------- mutations

    def allocate(self, request_id: RequestId, block_hashes: Sequence[DaemonKey], num_extra_blocks: int = 0,
                 token_ids: PackableTokenIds | None = None,
                 counting: QueryCounting = QueryCounting.QUERY_AND_HITS) -> AllocatedBlocks:
        """Give a new request one block per hash (hits first, the first miss ends the walk, then
        fresh blocks) and `num_extra_blocks` fresh blocks after them.

        With `token_ids` (the prompt's tokens), each hit is verified against the stored tokens:
        a hash collision is a miss. ResourceExhausted, changing nothing, when the pool is short.
        `counting`: what the walk adds to the observer's query and hit counts (query_counting.py).
        """
        if num_extra_blocks < 0:
            raise InvalidArgument(f"num_extra_blocks must be >= 0, got {num_extra_blocks}")
        with self._lock:
            if request_id in self.tables:
                raise FailedPrecondition(f"request {request_id!r} already holds blocks")
            hits = self._hits(block_hashes, token_ids)
            num_new_blocks = len(block_hashes) - len(hits) + num_extra_blocks
            reused = [block for block in hits if block.ref_cnt == 0]  # they leave the free queue
            self._check_room(reused, num_new_blocks)
            now = self._clock()
            observer = self._observer
            if observer is not None and reused:  # the gaps since release, which eviction competes with
                observer.on_reuse([now - block.released_at_s for block in reused])
            for block in hits:
                block.ref_cnt += 1
            self.free_queue.remove_many(reused)
            table = hits + self._pop_free(num_new_blocks, now)
            self.tables[request_id] = table
            if observer is not None and counting.counts:
                observer.on_query(len(block_hashes) * self.block_size, len(hits) * self.block_size)
            return AllocatedBlocks([block.block_id for block in table], len(hits))

    def append_blocks(self, request_id: RequestId, num_blocks: int) -> list[int]:
        """Grow a request's table by `num_blocks` fresh blocks (decode running past its last block)."""
        if num_blocks < 0:
            raise InvalidArgument(f"num_blocks must be >= 0, got {num_blocks}")
        with self._lock:
            table = self._table(request_id)
            self._check_room([], num_blocks)
            new_blocks = self._pop_free(num_blocks, self._clock())
            table.extend(new_blocks)
            return [block.block_id for block in new_blocks]

    def commit(self, request_id: RequestId, position: int, block_hash: DaemonKey, token_ids: PackableTokenIds,
               parent_hash: DaemonKey) -> bool:
        """Make the full block at `position` of the request's table shareable under `block_hash`.

        When another block already holds that hash this one becomes a further copy, serving hits
        once the older copies are gone. Committing the same hash twice is a no-op. Returns True.
        """
        return self.commit_blocks(request_id, position, [block_hash], token_ids, parent_hash) == 1

    def commit_blocks(self, request_id: RequestId, start_position: int, block_hashes: Sequence[DaemonKey],
                      token_ids: PackableTokenIds, parent_hash: DaemonKey) -> int:
        """Commit consecutive full blocks from `start_position` (what a prefill computed).

        `token_ids` are the tokens of exactly these blocks, or none at all (an engine that keys blocks
        by its own content hash and does not tell their tokens: lookups that pass tokens never hit
        such blocks, and their events carry no tokens); `parent_hash` is the hash before the
        first (the root for position 0), and each hash is the parent of the next. Returns how
        many of the blocks hold their hash afterwards (all of them). Everything is checked
        before anything changes: a bad argument raises and commits none of them.
        """
        token_bytes = pack_token_ids(token_ids)
        with self._lock:
            table = self._table(request_id)
            check_hashes([*block_hashes, parent_hash], self.hash_size)
            end_position = start_position + len(block_hashes)
            if not 0 <= start_position <= end_position <= len(table) or not block_hashes:
                raise InvalidArgument(f"positions {start_position}..{end_position - 1} are outside the "
                                      f"request's {len(table)} blocks")
            if token_bytes and len(token_bytes) != packed_size(self.block_size * len(block_hashes)):
                raise InvalidArgument(
                    f"{len(block_hashes)} blocks hold {self.block_size * len(block_hashes)} tokens, got "
                    f"{token_count(token_bytes)}: only full blocks are committed")
            expected_parent = table[start_position - 1].block_hash if start_position > 0 else self.root
            if expected_parent is not None and parent_hash != expected_parent:
                raise InvalidArgument(f"parent hash of position {start_position} does not match the chain")
            return self._store(table[start_position:end_position], block_hashes, [parent_hash, *block_hashes[:-1]],
                               tokens_of_blocks(token_bytes, len(block_hashes), self.block_size), self._clock())

    def free(self, request_id: RequestId) -> None:
        """Release a request's blocks tail first. A block whose ref_cnt reaches 0 joins the free
        queue: at the tail with its content and hash intact when it is cached, at the head when
        it holds no hash (nothing to keep: reused first, as vLLM's BlockPool.free_blocks does)."""
        with self._lock:
            table = self.tables.pop(request_id, None)
            if table is None:
                raise NotFound(f"request {request_id!r} holds no blocks")
            now = self._clock()
            released_cached, released_empty = [], []
            keep, reuse_first = released_cached.append, released_empty.append
            for block in reversed(table):
                assert block.ref_cnt > 0, f"block {block.block_id} freed more often than held"
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    block.released_at_s = now
                    if block.block_hash is None:
                        reuse_first(block)
                    else:
                        keep(block)
            self.free_queue.prepend_many(released_empty)
            self.free_queue.extend(released_cached)

    def fork(self, parent_id: RequestId, child_id: RequestId) -> list[int]:
        """A new request sharing every block of `parent_id` (n > 1 sampling): no copy, ref_cnt + 1."""
        with self._lock:
            table = self._table(parent_id)
            if child_id in self.tables:
                raise FailedPrecondition(f"request {child_id!r} already holds blocks")
            for block in table:
                block.ref_cnt += 1
            self.tables[child_id] = list(table)
            return [block.block_id for block in table]

    def hold(self, holder_id: RequestId, block_ids: Sequence[int]) -> None:
        """Take a reference on blocks for a reader that is not a request (a copy to a lower tier):
        they are neither evicted nor reused until `free(holder_id)`."""
        with self._lock:
            if holder_id in self.tables:
                raise FailedPrecondition(f"holder {holder_id!r} already holds blocks")
            if any(not 0 <= block_id < self.num_blocks for block_id in block_ids):
                raise InvalidArgument(f"block ids must be in [0, {self.num_blocks})")
            blocks = [self.blocks[block_id] for block_id in block_ids]
            self.free_queue.remove_many([block for block in blocks if block.ref_cnt == 0])
            for block in blocks:
                block.ref_cnt += 1
            self.tables[holder_id] = blocks

    def hold_hits(self, holder_id: RequestId, block_hashes: Sequence[DaemonKey], max_blocks: int,
                  token_ids: PackableTokenIds | None = None) -> int:
        """Take a reference on the chain's leading cached blocks (at most `max_blocks`) for a holder
        that is not a request (a Lookup's promise, until its Acquire): they are neither evicted nor
        reused until `free(holder_id)`. How many were held; none found: nothing held, no table."""
        with self._lock:
            if holder_id in self.tables:
                raise FailedPrecondition(f"holder {holder_id!r} already holds blocks")
            hits = self._hits(block_hashes, token_ids)[:max(0, max_blocks)]
            if hits:
                self.free_queue.remove_many([block for block in hits if block.ref_cnt == 0])
                for block in hits:
                    block.ref_cnt += 1
                self.tables[holder_id] = hits
            return len(hits)

    def prepare_write(self, request_id: RequestId, position: int) -> WriteTarget:
        """The block a request may write at `position`, copied first if anyone else holds it.

        Copy-on-write decides on the block's own ref_cnt, never on "is this table the only one":
        allocate a block, copy, repoint this request's table, ref_cnt - 1 on the old, then the
        caller writes. Committed blocks are immutable: writing into one is refused.
        """
        with self._lock:
            table = self._table(request_id)
            block = self._block_at(table, position)
            if block.block_hash is not None:
                raise FailedPrecondition(f"block {block.block_id} is committed; committed blocks are immutable")
            if block.ref_cnt == 1:
                return WriteTarget(block.block_id, None)
            assert block.ref_cnt > 1
            self._check_room([], 1)
            copy, = self._pop_free(1, self._clock())
            if self._copy_block is not None:
                try:
                    self._copy_block(block.block_id, copy.block_id)
                except BaseException:  # the copy failed: the fresh block goes back, nothing repointed
                    copy.ref_cnt = 0
                    self.free_queue.appendleft(copy)
                    raise
            table[position] = copy
            block.ref_cnt -= 1
            return WriteTarget(copy.block_id, block.block_id)

    # ----------------------------------------------------------------------------- internals

    def _table(self, request_id: RequestId) -> list[KVBlock]:
        table = self.tables.get(request_id)
        if table is None:
            raise NotFound(f"request {request_id!r} holds no blocks")
        return table

    def _block_at(self, table: list[KVBlock], position: int) -> KVBlock:
        if not 0 <= position < len(table):
            raise InvalidArgument(f"position {position} is outside the request's {len(table)} blocks")
        return table[position]

    def _num_blocks_short(self, queued_hits: list[KVBlock], num_new_blocks: int) -> int:
        """How many free blocks are missing for `num_new_blocks`, after the hits on released
        blocks (`queued_hits`, on the free queue) leave the queue."""
        return num_new_blocks - (self.free_queue.num_free_blocks - len(queued_hits))

    def _check_room(self, queued_hits: list[KVBlock], num_new_blocks: int) -> None:
        short = self._num_blocks_short(queued_hits, num_new_blocks)
        if short > 0:
            raise ResourceExhausted(
                f"device pool full: need {num_new_blocks} free blocks, {num_new_blocks - short} available "
                f"of {self.num_blocks}")
