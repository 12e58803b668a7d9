"""Put and Get: a client's block bytes written into T0 (and sent down by policy), and read back
from whichever tier holds them. The use cases behind the Put and Get RPCs, without grpc.

Both run on a private request of the tier manager's block index, so the blocks they touch are
held (neither evicted nor reused) while they write or read. Both are blocking — they write
bytes, wait for write-backs and promotions — so the daemon calls them off its event loop. Keys
are the daemon's keys (tenant tag + client hash, node/tenants.py); the caller checks quotas
through `admit(num_blocks)`, which raises to refuse. Neither knows the tier manager: it hands them
the tiers and movers they use, and the steps of its own they take (commit, release).

Both count in the hit-rate counters as Acquire does: every block asked for is a query block,
and a block served by T0, T1 or T2 a hit of that tier (a Put's block already in T0 is a T0 hit).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import InvalidArgument
from kvtierd.index.block_index import RequestId
from kvtierd.index.slot_entry import BlockMeta, chain_metas
from kvtierd.tier import Tier
from kvtierd.tiering.layout_tiers import Tiers
from kvtierd.tiering.offload import Offloader
from kvtierd.tiering.promotion import AcquiredBlocks, Promoter
from kvtierd.tiering.remote_stream import RemoteStream
from kvtierd.token_bytes import TokenBytes, block_span, packed_size

Admit = Callable[[int], None]  # called with a number of T0 blocks before they are taken; raises to refuse
# (request, start position, keys, packed token ids, parent key) -> how many of the blocks the request holds
CommitBlocks = Callable[[RequestId, int, list[DaemonKey], TokenBytes, DaemonKey], int]
Release = Callable[[RequestId], None]  # free a request's blocks, after any promotion into them


@dataclasses.dataclass(frozen=True, slots=True)
class PutBlock:
    """One block of a Put, keyed for the daemon."""

    key: DaemonKey
    token_ids: TokenBytes  # this block's
    data: memoryview  # bytes_per_block bytes


class BlockPut:
    """One Put: blocks written batch by batch into T0 blocks of the request, all committed when the
    stream has ended well (`commit`), then released (`close`): cached, and offloaded by policy like
    any block. A Put that fails midway commits nothing.

    `parent` is the key before the first block (the tenant's root, or the given parent's key);
    `commit_blocks` commits written blocks and starts them down by policy (TierManager.commit)."""

    def __init__(self, tiers: Tiers, offloader: Offloader, request_id: RequestId, parent: DaemonKey,
                 commit_blocks: CommitBlocks) -> None:
        self.tiers, self.offloader, self.request_id, self.parent = tiers, offloader, request_id, parent
        self._commit_blocks = commit_blocks
        self.commits: list[tuple[int, list[DaemonKey], TokenBytes, DaemonKey]] = []  # (position, keys, tokens, parent)
        self.num_blocks = self.num_already_cached = self.num_held_blocks = 0
        self.with_tokens: bool | None = None  # whether the blocks carry their tokens (the first block says)

    def check(self, block: PutBlock) -> None:
        """InvalidArgument for a block of the wrong size, before anything is written."""
        layout = self.tiers.layout
        if len(block.token_ids) not in (0, packed_size(layout.block_size)):
            raise InvalidArgument(f"a block holds {layout.block_size} tokens (u32), got {len(block.token_ids)} bytes")
        with_tokens = bool(block.token_ids)
        if self.with_tokens is None:
            self.with_tokens = with_tokens
        elif with_tokens != self.with_tokens:
            raise InvalidArgument("a Put's blocks either all carry their tokens or none does")
        if block.data.nbytes != layout.bytes_per_block:
            raise InvalidArgument(f"a block of this layout is {layout.bytes_per_block} bytes, got {block.data.nbytes}")

    def write(self, batch: Sequence[PutBlock], admit: Admit = lambda num_blocks: None) -> int:
        """Write a batch into new blocks of the request; blocks T0 already holds are not written.
        Returns how many blocks the request took for it. When T0 is full of blocks held by
        write-through copies, waits for them to go down (at most policy.write_through_wait_s)."""
        if not batch:
            return 0
        tiers = self.tiers
        keys = [block.key for block in batch]
        tokens = TokenBytes(b"".join(block.token_ids for block in batch))
        admit(len(batch))
        start = self.num_held_blocks
        with_t0_room = self.offloader.backlog.with_t0_room  # T0 full of write-through copies: wait for them
        if start == 0:
            allocation = with_t0_room(lambda: tiers.index.allocate(self.request_id, keys, 0, tokens or None))
            block_ids, num_hits = allocation.block_ids, allocation.num_hit_blocks
        else:
            block_ids, num_hits = with_t0_room(lambda: tiers.index.append_blocks(self.request_id, len(batch))), 0
            tiers.index.count_query(len(batch) * tiers.layout.block_size)
        self.num_held_blocks += len(block_ids)
        tiers.counters.count_queries(len(batch))
        tiers.counters.count_hits(Tier.T0, num_hits)
        landed = tiers.write_backs.when_landed(block_ids[num_hits:])
        if landed is not None:  # blocks just evicted: their old bytes are still being copied down
            landed.result()
        for block_id, block in zip(block_ids[num_hits:], batch[num_hits:]):
            tiers.pool.write_block(block_id, block.data)
        if num_hits < len(batch):
            parent = keys[num_hits - 1] if num_hits else self.parent
            rest_tokens = block_span(tokens, num_hits, None, tiers.layout.block_size)  # b"" stays b""
            self.commits.append((start + num_hits, keys[num_hits:], rest_tokens, parent))
            parents = [parent, *keys[num_hits:-1]]
            self.offloader.offer_received_to_t3(
                [BlockMeta(b.key, p, b.token_ids) for b, p in zip(batch[num_hits:], parents)],
                [b.data for b in batch[num_hits:]])
        self.num_already_cached += num_hits
        self.num_blocks += len(batch)
        self.parent = keys[-1]
        return len(block_ids)

    def commit(self) -> None:
        """Make every written block shareable; a block another request committed meanwhile counts
        as already cached."""
        for position, keys, tokens, parent in self.commits:
            num_held = self._commit_blocks(self.request_id, position, keys, tokens, parent)
            self.num_already_cached += len(keys) - num_held
        self.commits = []

    def close(self) -> None:
        """Release the request's blocks (idempotent; a Put's request has no promotion to wait for)."""
        if self.num_held_blocks:
            self.tiers.index.free(self.request_id)
            self.num_held_blocks = 0


class BlockGet:
    """One Get: the leading blocks of a chain found in any tier (whatever their load costs: the
    caller asked for bytes, it cannot recompute them here). The blocks in T0, T1 or T2 are
    promoted into T0 blocks of the request, read (`block_bytes`) while it holds them, released
    by `close`; the blocks after them that only T3 holds are streamed from the store as they
    land (`remote`, remote_stream.py) when T3 keeps raw blocks, else promoted with the rest.
    `release` frees the request's blocks after any promotion into them (TierManager.release)."""

    def __init__(self, tiers: Tiers, release: Release, request_id: RequestId, acquisition: AcquiredBlocks | None,
                 num_admitted_blocks: int = 0, remote: RemoteStream | None = None) -> None:
        self.tiers, self.request_id, self.acquisition = tiers, request_id, acquisition
        self._release = release
        self.num_local_blocks = len(acquisition.block_ids) if acquisition is not None else 0
        self.num_admitted_blocks = num_admitted_blocks
        self.remote = remote

    @classmethod
    def start(cls, tiers: Tiers, promoter: Promoter, release: Release, request_id: RequestId, keys: list[DaemonKey],
              token_ids: TokenBytes | None, admit: Admit = lambda num_blocks: None) -> BlockGet:
        """Find the chain's prefix in the tiers and start promoting what lies below T0."""
        hits = promoter.lookup(keys, token_ids, count_misses=True)  # T3's misses: here, its acquire asks no more
        num_hits = hits.num_blocks
        num_misses = len(keys) - num_hits  # the hits are counted by acquire (the streamed ones here)
        tiers.counters.count_queries(num_misses)
        tiers.index.count_query(num_misses * tiers.layout.block_size)
        if num_hits == 0:
            return cls(tiers, release, request_id, None)
        admit(num_hits)
        stream = bool(hits.t3) and tiers.remote_codec is not None and tiers.remote_codec.name == "raw"
        num_promoted = num_hits - hits.t3 if stream else num_hits
        acquisition = None
        if num_promoted:
            acquisition = promoter.acquire(request_id, keys[:num_promoted], 0, token_ids,  # bytes asked: no cost check
                                           recompute_s_per_token=None, num_t3_present=0 if stream else hits.t3)
        remote = None
        if stream:
            tiers.counters.count_queries(hits.t3)  # a query the acquire above did not make
            tiers.index.count_query(hits.t3 * tiers.layout.block_size)
            remote = RemoteStream(tiers, promoter.reads,
                                  chain_metas(keys, token_ids, num_promoted, num_hits, tiers.index.root,
                                              tiers.layout.block_size))
        return cls(tiers, release, request_id, acquisition, num_hits, remote)

    @property
    def future(self) -> concurrent.futures.Future[int]:
        """Resolves to how many leading blocks are readable in T0 (of `num_local_blocks`)."""
        if self.acquisition is not None:
            return self.acquisition.ticket.future
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        done.set_result(0)
        return done

    @property
    def num_blocks(self) -> int:
        """Blocks the Get admitted (the quota the caller holds for it)."""
        return self.num_admitted_blocks

    def block_bytes(self, position: int) -> memoryview:
        """The bytes of the request's block at `position`, on the host (a view on CPU pools)."""
        assert self.acquisition is not None, "a Get reads only the blocks it holds"
        return self.tiers.pool.block_bytes(self.acquisition.block_ids[position]).cpu().numpy().data

    def close(self) -> None:
        """Release the blocks, after any promotion into them has finished (may wait: idempotent)."""
        if self.acquisition is not None:
            self.acquisition = None
            self._release(self.request_id)

