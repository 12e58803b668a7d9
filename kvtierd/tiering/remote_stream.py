"""The part of a Get that only T3 holds, streamed: read from the shared store chunk by chunk and
handed to the caller as each chunk lands, without passing through T0.

A promotion into T0 (promotion.py) waits for every block before the first is readable; a Get
needs only the bytes. So the blocks after the chain's local hits are read `CHUNK_BLOCKS` at a
time (one GET pipeline per store node, the nodes in parallel) on the store's reader threads,
`LOOKAHEAD_CHUNKS` chunks in flight while the caller sends the one before. Each value is
verified (block_frame.py) against the block asked for and its parent; a chunk resolves to the
payloads of its leading blocks that passed, and then lands in T1 (inclusive tiers, as every
lower-tier read does), after its caller was given it. The stream ends after the first chunk that
came back short: the blocks after a missing or refused one are not sent (a Get returns the
chain's leading blocks).

Only for raw T3 values (a payload is then the block's bytes as T0 holds them); other codecs go
through T0 (block_io.py decides). Counting: the blocks are query blocks when the stream is made,
T3 hits as the caller takes them (`num_taken_blocks`), and the claimed blocks after a short chunk
T3 misses (a chunk read ahead that is not taken counts nothing).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvtierd.index.slot_entry import BlockMeta
from kvtierd.tier import Tier
from kvtierd.tiering.layout_tiers import Tiers
from kvtierd.tiering.lower_reads import LowerReads, known_token_bytes

if TYPE_CHECKING:  # the store's client loads where T3 is on
    from kvtierd.t3.remote_tier import RemoteTier

log = logging.getLogger(__name__)
CHUNK_BLOCKS = 8
LOOKAHEAD_CHUNKS = 3


class RemoteStream:
    """Thread-compatible: `chunks()` is iterated by one caller; the reads run on T3's readers."""

    def __init__(self, tiers: Tiers, reads: LowerReads, metas: list[BlockMeta]) -> None:
        assert tiers.remote is not None and tiers.remote_codec is not None and tiers.remote_codec.name == "raw" \
            and metas
        self.tiers, self.reads, self.metas = tiers, reads, metas
        self.remote: RemoteTier = tiers.remote
        self.num_taken_blocks = 0
        self._stopped = False

    def chunks(self) -> Iterator[concurrent.futures.Future[list[memoryview]]]:
        """Futures of the chunks' payloads in chain order. The caller waits for each before it
        asks for the next; the stream ends after a chunk shorter than asked (or when closed)."""
        in_flight: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
        next_start = 0
        try:
            while True:
                while not self._stopped and len(in_flight) < LOOKAHEAD_CHUNKS and next_start < len(self.metas):
                    num_blocks = min(CHUNK_BLOCKS, len(self.metas) - next_start)
                    in_flight.append((num_blocks, self._read(self.metas[next_start:next_start + num_blocks])))
                    next_start += num_blocks
                if not in_flight:
                    return
                num_blocks, future = in_flight.popleft()
                yield future
                payloads = future.result() if future.done() and future.exception() is None else []
                self.num_taken_blocks += len(payloads)
                self.tiers.counters.count_hits(Tier.T3, len(payloads))
                short = len(payloads) < num_blocks  # claimed by the probe, not there or refused
                num_missed = len(self.metas) - self.num_taken_blocks if short else 0
                self.remote.count_reads(len(payloads), num_missed, sum(len(p.obj) for p in payloads))
                if short:
                    self.tiers.counters.count_failed_loads(num_missed)
                    return
        finally:
            self._stopped = True

    def _read(self, metas: list[BlockMeta]) -> concurrent.futures.Future[list[memoryview]]:
        """Read one chunk on T3's reader threads: its future resolves to the payloads of the
        leading blocks that passed; they land in T1 after that."""
        tiers = self.tiers
        future: concurrent.futures.Future[list[memoryview]] = concurrent.futures.Future()

        def read() -> None:
            try:
                loaded, payloads = self.remote.load([m.block_hash for m in metas], metas[0].parent_hash,
                                                    known_token_bytes(metas, tiers.layout.block_size),
                                                    tiers.layout.block_size, counted=False)
            except BaseException as error:
                future.set_exception(error)
                return
            future.set_result(payloads)
            if loaded:
                try:
                    self.reads.land_t3(loaded, payloads)
                except Exception:  # T1 is a copy on the way; the caller has the bytes
                    log.exception("storing %d blocks read from T3 in T1 failed", len(loaded))

        self.remote.readers.submit(read)
        return future
