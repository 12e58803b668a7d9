"""`kvtierd simulate`: a multi-turn chat workload through the block index on a CPU device pool.

Every request does what a runner does: hash its prompt, acquire (hits first, then fresh blocks),
verify that each hit block holds exactly the KV a recompute would write, prefill the misses,
decode token by token (copy-on-write when a forked sample writes a shared block), commit each
block as it fills, and release at the end. KV values are a deterministic stand-in (a function of
the block's parent hash, the token and the slot), so a hit that served other bytes is caught.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterator

import torch
import xxhash

from kvtierd.block_hash import BlockHash, Namespace
from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import InvalidArgument, ResourceExhausted
from kvtierd.index.block_index import BlockIndex
from kvtierd.index.index_metrics import IndexStats
from kvtierd.layout import Layout
from kvtierd.planning.capacity import PoolCapacity, layout_lines
from kvtierd.planning.chat_workload import ChatWorkload, Conversations, Turn
from kvtierd.planning.fragmentation import Fragmentation, fragmentation
from kvtierd.t0.device_pool import DevicePool
from kvtierd.t0.factory import create_device_pool
from kvtierd.units import ceil_div

# A small Llama-shaped model, so the default pool fits a container's 64 MiB /dev/shm.
SIM_LAYOUT = Layout("kvtierd-sim-8l", num_layers=8, num_kv_heads=2, head_dim=64, block_size=16)
DECODE_STEP_S = 0.05  # simulated time of one decode step of the whole batch


def index_key(block_hash: BlockHash) -> DaemonKey:
    """The key the simulator's index holds a block under: its hash as it is. The daemon keys blocks
    by tenant tag + hash (daemon_key.py); one tenant needs no tag, and the index only compares keys."""
    return DaemonKey(block_hash)


def stand_in_kv(parent: bytes, token_id: int, slot: int) -> float:
    """The KV value of a token at a slot under a parent hash: an integer exact in fp16."""
    return float(xxhash.xxh3_64_intdigest(parent + token_id.to_bytes(4, "little") + bytes([slot])) % 1024)


@dataclasses.dataclass(slots=True)
class Sample:
    """One decoding sequence: its request id in the index, its tokens and full-block hashes."""

    request_id: int
    turn: Turn
    reply: list[int]
    tokens: list[int]
    chain: list[BlockHash]
    num_hit_tokens: int  # prompt tokens its turn found cached (counted on the first sample)

    @property
    def done(self) -> bool:
        return len(self.tokens) == len(self.turn.prompt) + len(self.reply)


@dataclasses.dataclass(slots=True)
class TurnStats:
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_hit_tokens: int = 0


@dataclasses.dataclass
class SimulationReport:
    workload: ChatWorkload
    num_pool_blocks: int
    per_turn: list[TurnStats]
    num_verified_hit_blocks: int
    num_mismatched_hit_blocks: int
    num_copy_on_write: int
    num_preemptions: int
    num_evictions: int
    num_free_blocks_after: int
    simulated_s: float
    stats: IndexStats
    fragmentation: Fragmentation

    @property
    def num_prompt_tokens(self) -> int:
        return sum(t.num_prompt_tokens for t in self.per_turn)

    @property
    def num_hit_tokens(self) -> int:
        return sum(t.num_hit_tokens for t in self.per_turn)


class ChatSimulator:
    """Runs a ChatWorkload against one BlockIndex and one DevicePool on a simulated clock."""

    def __init__(self, workload: ChatWorkload, num_pool_blocks: int, layout: Layout = SIM_LAYOUT) -> None:
        self.workload = workload
        self.layout = layout
        self.namespace = Namespace(layout)
        self.now_s = 0.0
        self.stats = IndexStats()
        self.pool: DevicePool = create_device_pool(layout, num_pool_blocks, device="shm")
        self.index = BlockIndex(num_pool_blocks, layout.block_size, root=index_key(self.namespace.root),
                                copy_block=self.pool.copy_block, observer=self.stats, clock=lambda: self.now_s)
        self._request_ids = itertools.count()
        self._per_turn = [TurnStats() for _ in range(workload.num_turns)]
        self._num_verified = self._num_mismatched = self._num_copies = self._num_preemptions = 0
        self._lengths: list[int] = []

    def close(self) -> None:
        self.pool.close()

    def run(self) -> SimulationReport:
        conversations = Conversations(self.workload)
        pending = [(t.arrival_s, i, t) for i, t in enumerate(conversations.first_turns())]
        heapq.heapify(pending)
        order = itertools.count(len(pending))
        running: list[list[Sample]] = []  # the samples of each admitted turn
        while pending or running:
            while pending and pending[0][0] <= self.now_s:
                try:
                    running.append(self._admit(pending[0][2]))
                except ResourceExhausted:
                    if not running:
                        raise InvalidArgument(
                            f"a pool of {self.index.num_blocks} blocks cannot hold one request of "
                            f"{len(pending[0][2].prompt)} tokens: raise --pool-blocks") from None
                    break  # wait for running turns to release blocks
                heapq.heappop(pending)
            if not running:
                self.now_s = max(self.now_s, pending[0][0])
                continue
            for samples in list(running):
                if samples in running:  # not preempted earlier in this step
                    self._decode_step(samples, running, pending, order)
            self.now_s += DECODE_STEP_S
            for samples in [s for s in running if all(sample.done for sample in s)]:
                running.remove(samples)
                for sample in samples:
                    self.index.free(sample.request_id)
                    self._lengths.append(len(sample.tokens))
                self._record(samples)
                follow_up = conversations.next_turn(samples[0].turn, self.now_s)
                if follow_up is not None:
                    heapq.heappush(pending, (follow_up.arrival_s, next(order), follow_up))
        return SimulationReport(
            self.workload, self.index.num_blocks, self._per_turn, self._num_verified, self._num_mismatched,
            self._num_copies, self._num_preemptions, self.stats.num_evictions, self.index.num_free_blocks, self.now_s,
            self.stats, fragmentation(self._lengths, self.layout.block_size))

    def _admit(self, turn: Turn) -> list[Sample]:
        """Acquire, verify hits, prefill the misses; fork when the turn samples n=2."""
        block_size = self.layout.block_size
        chain = self.namespace.hash_blocks(turn.prompt)
        total_tokens = len(turn.prompt) + len(turn.replies[0])
        num_blocks = ceil_div(total_tokens, block_size)
        request_id = next(self._request_ids)
        allocation = self.index.allocate(request_id, list(map(index_key, chain)), num_blocks - len(chain), turn.prompt)
        for position in range(allocation.num_hit_blocks):
            self._verify(allocation.block_ids[position], self._parent(chain, position),
                         turn.prompt[position * block_size:(position + 1) * block_size])
        first_computed = allocation.num_hit_blocks * block_size
        tensor = self.pool.tensor
        for offset in range(first_computed, len(turn.prompt)):
            position, slot = divmod(offset, block_size)
            tensor[allocation.block_ids[position], :, :, slot] = stand_in_kv(
                self._parent(chain, position), turn.prompt[offset], slot)
        for position in range(allocation.num_hit_blocks, len(chain)):
            self.index.commit(request_id, position, index_key(chain[position]),
                              turn.prompt[position * block_size:(position + 1) * block_size],
                              self._parent(chain, position))
        samples = [Sample(request_id, turn, turn.replies[0], list(turn.prompt), list(chain),
                          allocation.num_hit_blocks * block_size)]
        for reply in turn.replies[1:]:
            child_id = next(self._request_ids)
            self.index.fork(request_id, child_id)
            samples.append(Sample(child_id, turn, reply, list(turn.prompt), list(chain), 0))
        return samples

    def _record(self, samples: list[Sample]) -> None:
        """Count a finished turn once, with the hits of the admission that ran it."""
        stats = self._per_turn[samples[0].turn.turn]
        stats.num_requests += 1
        stats.num_prompt_tokens += len(samples[0].turn.prompt)
        stats.num_hit_tokens += samples[0].num_hit_tokens

    def _decode_step(self, samples: list[Sample], running: list[list[Sample]], pending: list,
                     order: Iterator[int]) -> None:
        """One token for each sample of a turn. When the pool has no block for a copy-on-write,
        the most recently admitted turn is preempted (released, requeued to recompute), as an
        engine does when KV memory runs out."""
        for sample in samples:
            if sample.done:
                continue
            try:
                self._decode_one(sample)
            except ResourceExhausted:
                victim = running[-1]
                if victim is samples and len(running) == 1:
                    raise InvalidArgument(
                        f"a pool of {self.index.num_blocks} blocks cannot hold one request of "
                        f"{len(sample.tokens)} tokens: raise --pool-blocks") from None
                running.remove(victim)
                for preempted in victim:
                    self.index.free(preempted.request_id)
                self._num_preemptions += 1
                heapq.heappush(pending, (self.now_s, next(order), victim[0].turn))
                if victim is samples:
                    return

    def _decode_one(self, sample: Sample) -> None:
        block_size = self.layout.block_size
        token = sample.reply[len(sample.tokens) - len(sample.turn.prompt)]
        position, slot = divmod(len(sample.tokens), block_size)
        target = self.index.prepare_write(sample.request_id, position)
        self._num_copies += target.copied_from is not None
        parent = self._parent(sample.chain, position)
        self.pool.tensor[target.block_id, :, :, slot] = stand_in_kv(parent, token, slot)
        sample.tokens.append(token)
        if slot == block_size - 1:
            block_tokens = sample.tokens[position * block_size:]
            block_hash = self.namespace.hash_blocks(
                block_tokens, start_block=position, parent=sample.chain[-1] if position else None)[0]
            self.index.commit(sample.request_id, position, index_key(block_hash), block_tokens, parent)
            sample.chain.append(block_hash)

    def _parent(self, chain: list[BlockHash], position: int) -> DaemonKey:
        return index_key(chain[position - 1] if position else self.namespace.root)

    def _verify(self, block_id: int, parent: bytes, tokens: list[int]) -> None:
        """A hit must hold the bytes a recompute would have written."""
        expected = torch.tensor([stand_in_kv(parent, t, slot) for slot, t in enumerate(tokens)],
                                dtype=self.layout.torch_dtype)
        block = self.pool.tensor[block_id]
        if torch.equal(block, expected.view(1, 1, -1, 1, 1).expand_as(block)):
            self._num_verified += 1
        else:
            self._num_mismatched += 1


def report_lines(report: SimulationReport, layout: Layout = SIM_LAYOUT) -> list[str]:
    """What `kvtierd simulate` prints."""
    w = report.workload
    capacity = PoolCapacity(layout, report.num_pool_blocks)
    mean_tokens = report.fragmentation.num_effective_tokens // max(1, report.fragmentation.num_requests)
    stats = report.stats
    lines = [
        f"kvtierd simulate: {w.num_conversations} conversations x {w.num_turns} turns, shared system prompt "
        f"{w.system_prompt_tokens:,} tokens, seed {w.seed}; T0 pool in CPU shared memory",
        *layout_lines(layout),
        *capacity.lines("T0 device pool", mean_tokens),
        f"fragmentation of the {report.fragmentation.num_requests} sequences run: {report.fragmentation.describe()}",
        "",
        f"{'turn':>4}  {'requests':>8}  {'prompt tokens':>13}  {'hit tokens':>10}  {'hit rate':>8}",
    ]
    for turn, t in enumerate(report.per_turn, start=1):
        rate = t.num_hit_tokens / t.num_prompt_tokens if t.num_prompt_tokens else 0.0
        lines.append(f"{turn:>4}  {t.num_requests:>8}  {t.num_prompt_tokens:>13,}  {t.num_hit_tokens:>10,}  "
                     f"{rate:>8.1%}")
    total_rate = report.num_hit_tokens / report.num_prompt_tokens if report.num_prompt_tokens else 0.0
    gap_p90, idle_p50 = stats.reuse_gap_s.percentile(90), stats.idle_before_evict_s.percentile(50)
    seconds = lambda value: "n/a" if math.isnan(value) else f"{value:.1f} s"  # noqa: E731
    lines += [
        "",
        f"prefix hit rate: {total_rate:.1%} of {report.num_prompt_tokens:,} prompt tokens "
        f"({report.num_hit_tokens:,} tokens not recomputed)",
        f"hits verified against recompute: {report.num_verified_hit_blocks:,} blocks, "
        f"{report.num_mismatched_hit_blocks} mismatched",
        f"evictions: {report.num_evictions:,} blocks; copy-on-write copies: {report.num_copy_on_write}; "
        f"preemptions: {report.num_preemptions}",
        f"block lifetime p50 {seconds(stats.lifetime_s.percentile(50))}; idle before evict p50 "
        f"{seconds(idle_p50)}; reuse gap p90 {seconds(gap_p90)} (simulated time {report.simulated_s:,.0f} s)",
        ("reuse gap p90 > idle-before-evict p50: blocks leave before they are reused; the pool is too small"
         if stats.pool_too_small() else "reuse gap p90 <= idle-before-evict p50: the pool holds the reuse distance"),
        f"free blocks after all requests finished: {report.num_free_blocks_after:,} of {report.num_pool_blocks:,}",
    ]
    return lines
