"""The reference runner's connector to kvtierd: its blocks are the daemon's.

Per request, in the order the daemon's design (docs/architecture.md §5-§7) gives:
1. hash the prompt's full blocks: the session's namespace, with the LoRA id on every block and
   the cache_salt on block 0 (block_hash.PromptExtras); the daemon mixes in the tenant;
2. Acquire one block per hash plus room for the partial last block and the first generated
   token: T0 hits first, then T1/T2 hits being promoted into fresh blocks, then fresh blocks;
   the Acquire reports the runner's measured prefill cost (seconds per token of its prefill
   forwards, prefill_cost.py), and the daemon loads only the lower-tier hits faster to load than
   to recompute at that cost;
3. Wait for the promotions, when there are any; the ready blocks are the cached prefix;
4. the runner prefills only the rest, and decodes; each block is committed as it fills, with
   its hash chained from the previous one and its token ids (so a collision is a miss);
5. n > 1 sampling forks the request (every block shared, ref_cnt + 1); the first write into
   the shared partial block asks PrepareWrite, which copies it when its ref_cnt > 1;
6. Release at the end. If the runner dies instead, the session's lease returns everything.

The runner writes and reads KV straight in the mapped pool; no KV byte crosses gRPC.
"""

from __future__ import annotations

import dataclasses

import torch

from kvtierd.block_hash import BlockHash, PromptExtras
from kvtierd.client import Session
from kvtierd.connectors.prefill_cost import PrefillCost
from kvtierd.connectors.reference.kv_backend import StartedSequence, num_blocks_for
from kvtierd.errors import InvalidArgument


@dataclasses.dataclass(slots=True)
class _Chain:
    """The hash chain of one request's committed blocks."""

    extras: PromptExtras
    block_hashes: list[BlockHash]  # hashes of blocks 0 .. num_committed - 1
    block_ids: list[int]  # the request's table, as the daemon last gave it

    @property
    def num_committed(self) -> int:
        return len(self.block_hashes)


class KvtierdConnector:
    """A KvBackend over a kvtierd Session whose pool this process has mapped.

    Invariant: for every running request, `block_hashes` are the hashes of its first
    `num_committed` table entries, each committed to the daemon exactly once, in order.
    """

    def __init__(self, session: Session) -> None:
        if session.pool is None:
            raise InvalidArgument("the runner needs a session whose pool is mapped (attach with map_pool=True)")
        self.session = session
        self.block_size = session.layout.block_size
        self._chains: dict[str, _Chain] = {}
        self.prefill_cost = PrefillCost(min_tokens=self.block_size)  # a forward of under a block is no sample

    @property
    def pool(self) -> torch.Tensor:
        assert self.session.pool is not None, "checked in __init__"
        return self.session.pool.tensor

    def start(self, request_id: str, prompt_token_ids: list[int], extras: PromptExtras) -> StartedSequence:
        if request_id in self._chains:
            raise InvalidArgument(f"request {request_id!r} is already running")
        block_size = self.block_size
        block_hashes = self.session.namespace.hash_blocks(prompt_token_ids, extras)
        num_blocks = num_blocks_for(len(prompt_token_ids) + 1, block_size)
        acquired = self.session.acquire(request_id, block_hashes, num_blocks - len(block_hashes),
                                        prompt_token_ids[:len(block_hashes) * block_size],
                                        recompute_s_per_token=self.prefill_cost.s_per_token)
        num_loaded = acquired.num_loading_blocks
        num_ready = self.session.wait(request_id) if acquired.pending else acquired.num_t0_hit_blocks
        num_ready = min(num_ready, acquired.num_t0_hit_blocks + num_loaded)
        self._chains[request_id] = _Chain(extras, list(block_hashes[:num_ready]), list(acquired.block_ids))
        # Tier counts as the daemon reported them; a failed load (num_ready short) is recomputed.
        num_t1 = min(acquired.num_t1_blocks, max(0, num_ready - acquired.num_t0_hit_blocks))
        num_t2 = min(acquired.num_t2_blocks, max(0, num_ready - acquired.num_t0_hit_blocks - num_t1))
        num_t3 = max(0, num_ready - acquired.num_t0_hit_blocks - num_t1 - num_t2)
        return StartedSequence(list(acquired.block_ids), min(num_ready * block_size, len(prompt_token_ids)),
                               min(num_ready, acquired.num_t0_hit_blocks) * block_size,
                               num_t1 * block_size, num_t2 * block_size, num_t3 * block_size)

    def grow(self, request_id: str, num_blocks: int) -> list[int]:
        new_block_ids = self.session.append_blocks(request_id, num_blocks)
        self._chains[request_id].block_ids.extend(new_block_ids)
        return new_block_ids

    def write_target(self, request_id: str, position: int) -> int:
        block_index = position // self.block_size  # PrepareWrite takes the block's place in the table
        block_id, _ = self.session.prepare_write(request_id, block_index)
        self._chains[request_id].block_ids[block_index] = block_id
        return block_id

    def blocks_filled(self, request_id: str, token_ids: list[int], num_tokens_with_kv: int) -> None:
        """Commit every block that became full since the last call, in one Commit."""
        chain = self._chains[request_id]
        block_size = self.block_size
        start, end = chain.num_committed, num_tokens_with_kv // block_size
        if end <= start:
            return
        parent = chain.block_hashes[-1] if start else None
        new_hashes = self.session.namespace.hash_blocks(token_ids[start * block_size:end * block_size], chain.extras,
                                                        start_block=start, parent=parent)
        self.session.commit(request_id, chain.block_ids[start:end], new_hashes,
                            token_ids[start * block_size:end * block_size], parent)
        chain.block_hashes.extend(new_hashes)

    def fork(self, request_id: str, child_request_id: str) -> list[int]:
        block_ids = self.session.fork(request_id, child_request_id)
        parent = self._chains[request_id]
        self._chains[child_request_id] = _Chain(parent.extras, list(parent.block_hashes), list(block_ids))
        return block_ids

    def finish(self, request_id: str) -> None:
        self._chains.pop(request_id, None)
        self.session.release(request_id)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self.prefill_cost.observe(num_tokens, seconds)
