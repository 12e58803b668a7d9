"""kvtierd's device-tier BlockIndex hits what vLLM's own prefix cache hits, request by request.

Both are driven with the same request sequences: vLLM's real KVCacheManager
(vllm/v1/core/kv_cache_manager.py, one full-attention group, caching on) the way its scheduler
drives it, and kvtierd's BlockIndex the way the connector's scheduler side and `kvtierd simulate`
drive it. Per request the test compares the number of prefix-hit blocks and the block table
(vLLM's block ids are ours + 1: vLLM takes block 0 as its null block, and both pools hand out
blocks from the same free-queue order), so a difference in which copy a hit takes, when a copy
leaves the table or in which order freed blocks are reused fails here.

Runs in the vLLM venv (tests/connectors/vllm/test_on_installed_vllm.py runs this folder).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvtierd.block_hash import Namespace
from kvtierd.index.block_index import BlockIndex
from kvtierd.layout import Layout
from kvtierd.units import ceil_div

BLOCK_SIZE = 16
NUM_POOL_BLOCKS = 40  # usable blocks; vLLM's pool has one more, its null block
MAX_HELD_REQUESTS = 3
MAX_REQUEST_BLOCKS = 13  # 3 requests of at most 13 blocks fit the 40 blocks: no preemption
NAMESPACE = Namespace(Layout("differential", num_layers=1, num_kv_heads=1, head_dim=8, block_size=BLOCK_SIZE))


class VllmPrefixCache:
    """vLLM's KVCacheManager, called as vllm/v1/core/sched/scheduler.py calls it: a new request
    gets `get_computed_blocks` (which stops one token short: the last token is always
    recomputed) then `allocate_slots` for the rest of its prompt; each decode step
    `allocate_slots(request, 1)`; a finished request `free` (its blocks in reverse order)."""

    def __init__(self, num_blocks: int) -> None:
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16)
        config = KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.manager = KVCacheManager(config, max_model_len=4096, scheduler_block_size=BLOCK_SIZE,
                                      hash_block_size=BLOCK_SIZE, enable_caching=True)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self._requests: dict[str, Request] = {}

    def admit(self, request_id: str, prompt: list[int], first_output: int) -> int:
        """Prefill the prompt; the model samples `first_output`. Returns the hit blocks."""
        request = Request(request_id, prompt, SamplingParams(max_tokens=1 << 16), None, block_hasher=self._hasher)
        hit_blocks, num_hit_tokens = self.manager.get_computed_blocks(request)[:2]
        assert self.manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens,
                                           hit_blocks) is not None, "the driver admits only what fits"
        request.num_computed_tokens = request.num_tokens
        request.append_output_token_ids(first_output)
        self._requests[request_id] = request
        return num_hit_tokens // BLOCK_SIZE

    def decode(self, request_id: str, next_output: int) -> None:
        """The last sampled token is fed (it gets a slot and its KV); the model samples `next_output`."""
        request = self._requests[request_id]
        assert self.manager.allocate_slots(request, 1) is not None, "the driver admits only what fits"
        request.num_computed_tokens += 1
        request.append_output_token_ids(next_output)

    def free(self, request_id: str) -> None:
        self.manager.free(self._requests.pop(request_id))

    def block_table(self, request_id: str) -> list[int]:
        return [block_id - 1 for block_id in self.manager.get_block_ids(request_id)[0]]


@dataclasses.dataclass
class _Held:
    tokens_with_kv: list[int]  # what has KV in the request's blocks
    chain: list[bytes]  # the hashes of its full blocks
    next_token: int  # sampled, not fed yet


class KvtierdIndex:
    """kvtierd's BlockIndex, driven like vLLM's: the lookup chain stops one token short
    (`(num_tokens - 1) // block_size` blocks, as kvtierd/connectors/vllm/scheduler.py asks), the
    rest of the prompt gets fresh blocks, each full block is committed once its KV is computed,
    a decode step that crosses into a new block appends one, and `free` releases tail first."""

    def __init__(self, num_blocks: int) -> None:
        self.index = BlockIndex(num_blocks, BLOCK_SIZE, root=NAMESPACE.root)
        self._held: dict[str, _Held] = {}

    def admit(self, request_id: str, prompt: list[int], first_output: int) -> int:
        chain = NAMESPACE.hash_blocks(prompt)
        num_lookup_blocks = (len(prompt) - 1) // BLOCK_SIZE
        num_extra_blocks = ceil_div(len(prompt), BLOCK_SIZE) - num_lookup_blocks
        assert self.index.can_allocate(chain[:num_lookup_blocks], num_extra_blocks, prompt)
        allocation = self.index.allocate(request_id, chain[:num_lookup_blocks], num_extra_blocks, prompt)
        num_hits = allocation.num_hit_blocks
        if num_hits < len(chain):
            computed = prompt[num_hits * BLOCK_SIZE:len(chain) * BLOCK_SIZE]
            self.index.commit_blocks(request_id, num_hits, chain[num_hits:], computed, self._parent(chain, num_hits))
        self._held[request_id] = _Held(list(prompt), chain, first_output)
        return num_hits

    def decode(self, request_id: str, next_output: int) -> None:
        held = self._held[request_id]
        if len(held.tokens_with_kv) % BLOCK_SIZE == 0:
            self.index.append_blocks(request_id, 1)
        held.tokens_with_kv.append(held.next_token)
        held.next_token = next_output
        if len(held.tokens_with_kv) % BLOCK_SIZE == 0:
            position = len(held.chain)
            block_tokens = held.tokens_with_kv[position * BLOCK_SIZE:]
            parent = self._parent(held.chain, position)
            block_hash, = NAMESPACE.hash_blocks(block_tokens, start_block=position, parent=parent if position else None)
            self.index.commit(request_id, position, block_hash, block_tokens, parent)
            held.chain.append(block_hash)

    def free(self, request_id: str) -> None:
        del self._held[request_id]
        self.index.free(request_id)

    def block_table(self, request_id: str) -> list[int]:
        return self.index.block_table(request_id)

    @staticmethod
    def _parent(chain: list[bytes], position: int) -> bytes:
        return chain[position - 1] if position else NAMESPACE.root


@dataclasses.dataclass(frozen=True)
class Admitted:
    request_id: str
    num_prompt_tokens: int
    num_vllm_hits: int
    num_kvtierd_hits: int
    vllm_table: tuple[int, ...]
    kvtierd_table: tuple[int, ...]


class Both:
    """Every call goes to vLLM first, then to kvtierd; admissions are recorded side by side."""

    def __init__(self, num_blocks: int) -> None:
        self.vllm = VllmPrefixCache(num_blocks)
        self.kvtierd = KvtierdIndex(num_blocks)
        self.admitted: list[Admitted] = []

    def admit(self, request_id: str, prompt: list[int], first_output: int) -> None:
        num_vllm_hits = self.vllm.admit(request_id, prompt, first_output)
        num_kvtierd_hits = self.kvtierd.admit(request_id, prompt, first_output)
        self.admitted.append(Admitted(request_id, len(prompt), num_vllm_hits, num_kvtierd_hits,
                                      tuple(self.vllm.block_table(request_id)),
                                      tuple(self.kvtierd.block_table(request_id))))

    def decode(self, request_id: str, next_output: int) -> None:
        self.vllm.decode(request_id, next_output)
        self.kvtierd.decode(request_id, next_output)

    def free(self, request_id: str) -> None:
        self.vllm.free(request_id)
        self.kvtierd.free(request_id)

    def differing_hits(self) -> list[Admitted]:
        return [a for a in self.admitted if a.num_vllm_hits != a.num_kvtierd_hits]

    def differing_tables(self) -> list[Admitted]:
        return [a for a in self.admitted if a.vllm_table != a.kvtierd_table]


@dataclasses.dataclass
class _Running:
    request_id: str
    reply: list[int]
    num_fed: int  # reply tokens fed so far (the first is sampled by the prefill)
    num_max_blocks: int
    conversation: int


def run_chat_workload(seed: int, num_requests: int = 300) -> Both:
    """Random multi-turn chats with shared system prompts, up to 3 requests held at once.

    A turn's prompt is the conversation so far (previous prompt + reply + a new user message);
    some requests resend an earlier prompt (a retry), and some system prompts end on a block
    boundary, so a fully cached prompt recomputes its last block: the duplicate copies.
    """
    rng = random.Random(seed)
    tokens = iter(range(1000, 1 << 30))
    fresh = lambda n: [next(tokens) for _ in range(n)]  # noqa: E731
    system_prompts = [fresh(n) for n in (32, 48, 20, 37)]
    conversations: list[list[int]] = []  # the tokens of each conversation so far
    sent: list[list[int]] = []
    both = Both(NUM_POOL_BLOCKS)
    running: list[_Running] = []
    num_admitted = 0
    while num_admitted < num_requests or running:
        busy = {r.conversation for r in running}
        if num_admitted < num_requests and len(running) < MAX_HELD_REQUESTS and rng.random() < 0.6:
            if sent and rng.random() < 0.15:
                conversation, prompt = -1, list(rng.choice(sent))  # a retry of an earlier prompt
            else:
                idle = [c for c in range(len(conversations)) if c not in busy]
                if idle and rng.random() < 0.7:
                    conversation = rng.choice(idle)
                    prompt = conversations[conversation] + fresh(rng.randint(1, 24))
                else:
                    conversation = len(conversations)
                    conversations.append([])
                    prompt = rng.choice(system_prompts) + fresh(rng.choice([0, 0, 3, 9, 16, 21]))
                if len(prompt) > (MAX_REQUEST_BLOCKS - 3) * BLOCK_SIZE:  # the conversation ends; a new one
                    conversations[conversation] = []
                    prompt = rng.choice(system_prompts) + fresh(rng.randint(0, 20))
            reply = fresh(rng.randint(1, 30))
            num_max_blocks = ceil_div(len(prompt) + len(reply) - 1, BLOCK_SIZE)
            assert num_max_blocks <= MAX_REQUEST_BLOCKS
            if sum(r.num_max_blocks for r in running) + num_max_blocks <= NUM_POOL_BLOCKS:
                request_id = f"req-{num_admitted}"
                both.admit(request_id, prompt, reply[0])
                sent.append(prompt)
                running.append(_Running(request_id, reply, 1, num_max_blocks, conversation))
                if conversation >= 0:
                    conversations[conversation] = prompt + reply
                num_admitted += 1
                continue
        for r in running:  # one decode step of the batch, in admission order
            if r.num_fed < len(r.reply):
                next_output = r.reply[r.num_fed + 1] if r.num_fed + 1 < len(r.reply) else next(tokens)
                both.decode(r.request_id, next_output)
                r.num_fed += 1
        for r in [r for r in running if r.num_fed == len(r.reply)]:
            both.free(r.request_id)
            running.remove(r)
    return both


def describe(admitted: list[Admitted]) -> str:
    return "; ".join(f"{a.request_id} ({a.num_prompt_tokens} tokens): vLLM {a.num_vllm_hits} hits "
                     f"{list(a.vllm_table)}, kvtierd {a.num_kvtierd_hits} {list(a.kvtierd_table)}"
                     for a in admitted[:5])


def test_a_second_copy_of_a_hash_serves_hits_after_the_first_is_evicted():
    """A and B commit the same two blocks (B recomputes the last), C evicts A's copy of block 1,
    D (A + one block) still hits 2 blocks in vLLM: kvtierd too."""
    both = Both(num_blocks=4)
    a, c, d_tail = list(range(32)), list(range(1000, 1032)), list(range(500, 516))
    for request_id, prompt in (("A", a), ("B", a), ("C", c), ("D", a + d_tail)):
        both.admit(request_id, prompt, first_output=7)
        both.free(request_id)
    assert [x.num_vllm_hits for x in both.admitted] == [0, 1, 0, 2]  # what vLLM does
    assert [x.num_kvtierd_hits for x in both.admitted] == [0, 1, 0, 2]
    assert not both.differing_tables(), describe(both.differing_tables())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_chats_hit_the_same_blocks_as_vllms_prefix_cache(seed):
    """~300 requests of shared system prompts and growing conversations: per request, the same
    number of hit blocks and the same block table as vLLM's KVCacheManager."""
    both = run_chat_workload(seed)
    assert len(both.admitted) == 300
    assert sum(a.num_vllm_hits for a in both.admitted) > 300  # the workload shares prefixes
    assert any(a.num_vllm_hits for a in both.admitted[-50:])  # and still hits under eviction
    differing = both.differing_hits()
    assert not differing, (f"{len(differing)} of {len(both.admitted)} requests hit differently "
                           f"(kvtierd {sum(a.num_kvtierd_hits for a in both.admitted)} hit blocks, vLLM "
                           f"{sum(a.num_vllm_hits for a in both.admitted)}): {describe(differing)}")
    assert not both.differing_tables(), describe(both.differing_tables())
