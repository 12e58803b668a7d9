"""Block index: allocate + commit + free of a 4k-token prompt, per block, beside vLLM's BlockPool and a dict.

One round is what a runner does for one request: `allocate(request, hashes)`, `commit` of every
block that missed (the hits are committed already), `free(request)`. It is timed at 0 %, 50 % and
100 % prefix hits in a pool large enough that nothing is evicted, and at 0 % hits in a pool full
of cached blocks, where every fresh block evicts one. Extra rows: 100 % hits with token
verification (`token_ids` passed to allocate), and token ids as a Python list instead of packed
u32 bytes (the daemon's wire format; a list costs ~7 ns a token to pack).

Baseline: for each of the prompt's 256 hash keys, `d[k] = v; del d[k]` on a plain dict, the
least a hash-keyed index can do per block. Goal: ours <= 8x the baseline (ns/block over ns/key).

Peer (the rows' goal): vLLM's own prefix cache doing the same round at the BlockPool level, the
level that does the work ours does and nothing more: `FullAttentionManager.find_longest_cache_hit`
(the walk vLLM's coordinator runs for a one-group model), `BlockPool.touch` of the hits,
`get_new_blocks` for the misses, `cache_full_blocks` of the misses, `free_blocks` of the table in
reverse (as `SingleTypeKVCacheManager.free` orders it). KVCacheManager.allocate_slots / free would
add the scheduler's bookkeeping (Request state, slot counts, stats) that our index does not do.
The walk runs to the prompt's end (`max_length` = its tokens), so 100 % hits are 256 on both sides.
The work per block is close, not equal: ours also checks every hash's type and size, verifies
each hit's parent hash, and keeps each committed block's parent and tokens (for verification and
events); vLLM packs a group id into every key it looks up or caches. vLLM's `evict_blocks` (the
setup's) drops hashes and leaves the blocks where they are in its free queue; the setup asserts on
both sides that no fresh block of the next round evicts, except in the full-pool row.
vLLM's own hashes (sha256, from its request block hasher) key its pool; its block 0 is its null
block, so its pool has one block more. Goal: ours <= 1.0x vLLM per block, every row. The vLLM
rows need vLLM importable (`.venv-vllm/bin/python benchmarks/bench_block_index.py`); without it
the script says so and prints the dict rows only. Ours, the dict and vLLM are timed in one
interleaved loop (`_report.time_interleaved`), so the two tables come from the same rounds.

Untimed setup between rounds restores the starting state (evicting what the round committed, or
moving on to a prompt that is no longer cached) and asserts the hit count of the previous round.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report  # noqa: E402
from kvtierd.block_hash import BlockHash, Namespace  # noqa: E402
from kvtierd.index.allocation import AllocatedBlocks  # noqa: E402
from kvtierd.index.block_index import BlockIndex  # noqa: E402
from kvtierd.layout import llama3_8b  # noqa: E402

NUM_PROMPT_TOKENS = 4096
BLOCK_SIZE = 16
NUM_PROMPT_BLOCKS = NUM_PROMPT_TOKENS // BLOCK_SIZE  # 256
NUM_POOL_BLOCKS = 4096  # 16 prompts: room for 0 % and 100 % without eviction
NUM_HALF_HIT_BLOCKS = NUM_PROMPT_BLOCKS // 2
VOCAB_SIZE = 128_256  # Llama 3
GOAL_RATIO = 8.0  # ours over the dict
PEER_GOAL_RATIO = 1.0  # ours over vLLM's BlockPool
REQUEST_ID = "bench"

TIMING_NOTE = ("timing: time.perf_counter_ns per round, ours, the dict and vLLM in turn within each round; warm-up "
               "rounds discarded; gc disabled while timing; median over rounds (best in brackets)")

NAMESPACE = Namespace(llama3_8b(BLOCK_SIZE), tenant="bench", algo="sha256")


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt and everything a runner holds for it before it calls the index."""

    token_ids: list[int]
    token_bytes: bytes  # the same tokens packed as u32 little-endian: the daemon's wire format
    block_hashes: list[BlockHash]
    parent_hashes: list[BlockHash]  # parent_hashes[i] is the parent of block i


def make_prompt(rng: np.random.Generator) -> Prompt:
    token_array = rng.integers(0, VOCAB_SIZE, NUM_PROMPT_TOKENS, dtype=np.uint32)
    token_ids = token_array.tolist()
    block_hashes = NAMESPACE.hash_blocks(token_ids)
    assert len(block_hashes) == NUM_PROMPT_BLOCKS
    return Prompt(
        token_ids=token_ids,
        token_bytes=token_array.astype("<u4").tobytes(),
        block_hashes=block_hashes,
        parent_hashes=[NAMESPACE.root, *block_hashes[:-1]],
    )


def new_index() -> BlockIndex:
    """Defaults a daemon runs with: monotonic clock, no observer, no event queue."""
    return BlockIndex(NUM_POOL_BLOCKS, BLOCK_SIZE, hash_size=NAMESPACE.digest_size, root=NAMESPACE.root)


def run_request(index: BlockIndex, prompt: Prompt, tokens: str = "packed",
                verify: bool = False) -> AllocatedBlocks:
    """The timed operation: allocate, commit every block that missed (in one call, as a runner
    commits its prefill), free. Token ids go in packed (u32 bytes, the wire format) or as a list."""
    token_ids = prompt.token_bytes if tokens == "packed" else prompt.token_ids
    allocation = index.allocate(REQUEST_ID, prompt.block_hashes, token_ids=token_ids if verify else None)
    first_miss = allocation.num_hit_blocks
    if first_miss < NUM_PROMPT_BLOCKS:
        start = first_miss * BLOCK_SIZE * (4 if tokens == "packed" else 1)
        index.commit_blocks(REQUEST_ID, first_miss, prompt.block_hashes[first_miss:], token_ids[start:],
                            prompt.parent_hashes[first_miss])
    index.free(REQUEST_ID)
    return allocation


def cache_prompt(index: BlockIndex, prompt: Prompt) -> None:
    """Allocate, commit and free a prompt so all its blocks are cached (ref_cnt 0)."""
    allocation = run_request(index, prompt)
    assert allocation.num_hit_blocks == 0


@dataclasses.dataclass(slots=True)
class Case:
    """One row: a timed operation, the setup that restores its starting state, its baseline keys,
    and vLLM's same round when vLLM is importable (`peer`, None for the extra rows)."""

    name: str
    num_hit_blocks: int
    op: Callable[[], object]
    setup: Callable[[], None]
    keys: list[BlockHash]
    peer: PeerCase | None = None

    def setup_both(self) -> None:
        self.setup()
        if self.peer is not None:
            self.peer.setup()


@dataclasses.dataclass(slots=True)
class PeerCase:
    """vLLM's side of a row: its timed round and the setup that restores its starting state."""

    op: Callable[[], object]
    setup: Callable[[], None]


class VllmPrefixCache:
    """vLLM's BlockPool with one full-attention group, driven at the level our index works at
    (see the module docstring): a round is walk, touch, new blocks, cache the misses, free."""

    def __init__(self) -> None:
        import torch
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        self.pool = BlockPool(NUM_POOL_BLOCKS + 1, enable_caching=True, hash_block_size=BLOCK_SIZE)
        self.spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
        self._find_longest_cache_hit = FullAttentionManager.find_longest_cache_hit
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)

    def request(self, prompt: Prompt) -> object:
        """vLLM's Request for a prompt, its block hashes computed by vLLM's hasher (untimed)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(REQUEST_ID, prompt.token_ids, SamplingParams(max_tokens=1), None, block_hasher=self._hasher)
        assert len(request.block_hashes) == NUM_PROMPT_BLOCKS
        return request

    def run_request(self, request) -> int:
        """The timed round; returns the number of hit blocks."""
        pool = self.pool
        (hits,), _ = self._find_longest_cache_hit(request.block_hashes, NUM_PROMPT_TOKENS, [0], pool, self.spec,
                                                  False, BLOCK_SIZE)
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(NUM_PROMPT_BLOCKS - len(hits))
        pool.cache_full_blocks(request, blocks, len(hits), NUM_PROMPT_BLOCKS, BLOCK_SIZE, 0)
        pool.free_blocks(reversed(blocks))
        return len(hits)

    def cache(self, request) -> None:
        assert self.run_request(request) == 0

    def evict(self, block_hashes: Sequence[bytes]) -> None:
        """Drop the named hashes from the prefix cache (their blocks stay in the free queue, empty)."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        get_one_block = self.pool.cached_block_hash_to_block.get_one_block
        blocks = [get_one_block(make_block_hash_with_group_id(block_hash, 0)) for block_hash in block_hashes]
        self.pool.evict_blocks({block.block_id for block in blocks if block is not None})

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.cached_block_hash_to_block)

    def next_victim_is_cached(self) -> bool:
        return self.pool.free_block_queue.fake_free_list_head.next_free_block.block_hash is not None


def vllm_fixed_prompt_case(name: str, prompt: Prompt, num_cached_blocks: int) -> PeerCase:
    """vLLM's side of `fixed_prompt_case`, in a pool of its own."""
    vllm = VllmPrefixCache()
    request = vllm.request(prompt)
    vllm.cache(request)
    to_evict = request.block_hashes[num_cached_blocks:]
    vllm.evict(to_evict)
    last: list[int] = []

    def op() -> None:
        last.append(vllm.run_request(request))

    def setup() -> None:
        if last:
            assert last.pop() == num_cached_blocks, f"vLLM {name}"
        vllm.evict(to_evict)
        assert vllm.num_cached_blocks == num_cached_blocks, f"vLLM {name}"
        assert not vllm.next_victim_is_cached(), f"vLLM {name}: fresh blocks need no eviction"

    return PeerCase(op, setup)


def vllm_evicting_case(prompts: list[Prompt]) -> PeerCase:
    """vLLM's side of `evicting_case`, in a pool of its own: the same 17 prompts in the same turn."""
    vllm = VllmPrefixCache()
    num_pool_prompts = NUM_POOL_BLOCKS // NUM_PROMPT_BLOCKS
    requests = [vllm.request(prompt) for prompt in prompts]
    for request in requests[:num_pool_prompts]:
        vllm.cache(request)
    state = {"next": num_pool_prompts, "request": requests[num_pool_prompts]}
    last: list[int] = []

    def op() -> None:
        last.append(vllm.run_request(state["request"]))

    def setup() -> None:
        if last:
            assert last.pop() == 0, "vLLM evicting case"
        state["request"] = requests[state["next"]]
        state["next"] = (state["next"] + 1) % len(requests)
        assert vllm.num_cached_blocks == NUM_POOL_BLOCKS, "vLLM: the pool must be full of cached blocks"
        assert vllm.next_victim_is_cached(), "vLLM: the next fresh block must evict"

    return PeerCase(op, setup)


def import_vllm() -> str | None:
    """None when vLLM is importable, else why not (the vLLM rows are skipped)."""
    try:
        import vllm.v1.core.block_pool  # noqa: F401
    except ImportError as error:
        return str(error)
    return None


def fixed_prompt_case(name: str, prompt: Prompt, num_cached_blocks: int,
                      tokens: str = "packed", verify: bool = False, with_vllm: bool = False) -> Case:
    """A case that runs the same prompt every round, with its first `num_cached_blocks` cached."""
    index = new_index()
    cache_prompt(index, prompt)
    to_evict = prompt.block_hashes[num_cached_blocks:]
    index.evict(to_evict)
    last: list[AllocatedBlocks] = []

    def op() -> None:
        last.append(run_request(index, prompt, tokens, verify))

    def setup() -> None:
        if last:
            assert last.pop().num_hit_blocks == num_cached_blocks, name
        index.evict(to_evict)  # what this round committed beyond the cached prefix
        assert index.num_cached_blocks == num_cached_blocks and index.num_free_blocks == NUM_POOL_BLOCKS, name
        assert index.free_queue.peekleft().block_hash is None, name  # fresh blocks need no eviction

    peer = vllm_fixed_prompt_case(name, prompt, num_cached_blocks) if with_vllm else None
    return Case(name, num_cached_blocks, op, setup, prompt.block_hashes, peer)


def evicting_case(rng: np.random.Generator, with_vllm: bool = False) -> Case:
    """0 % hits in a pool full of cached blocks: every fresh block evicts the head of the queue.

    The pool holds 16 prompts; 17 prompts run in turn, so each one was evicted before it comes
    back and each round evicts the blocks of the prompt that ran 16 rounds earlier.
    """
    num_pool_prompts = NUM_POOL_BLOCKS // NUM_PROMPT_BLOCKS
    prompts = [make_prompt(rng) for _ in range(num_pool_prompts + 1)]
    index = new_index()
    for prompt in prompts[:num_pool_prompts]:
        cache_prompt(index, prompt)
    state = {"next": num_pool_prompts, "prompt": prompts[num_pool_prompts]}
    last: list[AllocatedBlocks] = []

    def op() -> None:
        last.append(run_request(index, state["prompt"]))

    def setup() -> None:
        if last:
            assert last.pop().num_hit_blocks == 0, "evicting case"
        state["prompt"] = prompts[state["next"]]
        state["next"] = (state["next"] + 1) % len(prompts)
        assert index.num_cached_blocks == NUM_POOL_BLOCKS, "the pool must be full of cached blocks"
        assert index.free_queue.peekleft().block_hash is not None, "the next fresh block must evict"

    peer = vllm_evicting_case(prompts) if with_vllm else None
    return Case("0% hits, pool full: each fresh block evicts", 0, op, setup, prompts[0].block_hashes, peer)


def dict_insert_delete(keys: list[BlockHash]) -> Callable[[], None]:
    """The baseline: one dict insert and one delete per key."""
    table: dict[bytes, object] = {}
    value = object()

    def op() -> None:
        for key in keys:
            table[key] = value
            del table[key]

    return op


def main(argv: Sequence[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    rounds, warmup = (15, 3) if args.quick else (600, 60)
    why_no_vllm = import_vllm()
    with_vllm = why_no_vllm is None
    rng = np.random.default_rng(20240601)
    prompt = make_prompt(rng)
    cases = [
        fixed_prompt_case("0% hits", prompt, 0, with_vllm=with_vllm),
        fixed_prompt_case("50% hits (first 128 blocks cached)", prompt, NUM_HALF_HIT_BLOCKS, with_vllm=with_vllm),
        fixed_prompt_case("100% hits", prompt, NUM_PROMPT_BLOCKS, with_vllm=with_vllm),
        evicting_case(rng, with_vllm=with_vllm),
        fixed_prompt_case("[extra] 0% hits, token ids as list[int]", prompt, 0, tokens="list"),
        fixed_prompt_case("[extra] 100% hits + token check, packed", prompt, NUM_PROMPT_BLOCKS, verify=True),
        fixed_prompt_case("[extra] 100% hits + token check, list[int]", prompt, NUM_PROMPT_BLOCKS,
                          tokens="list", verify=True),
    ]
    _report.print_header(
        f"Block index: allocate + commit misses + free, {NUM_PROMPT_TOKENS}-token prompt, block {BLOCK_SIZE} "
        f"({NUM_PROMPT_BLOCKS} blocks), pool {NUM_POOL_BLOCKS} blocks, sha256 keys", args.quick, TIMING_NOTE)
    print("baseline: dict insert + delete, `d[k] = v; del d[k]` for each of the prompt's 256 keys (ns/key)")
    print("peer: vLLM's BlockPool, the same round (find_longest_cache_hit, touch, get_new_blocks, "
          "cache_full_blocks, free_blocks)")
    print(f"goal: ours <= {GOAL_RATIO:g}x baseline, ours <= {PEER_GOAL_RATIO:g}x vLLM; "
          f"{rounds} rounds each after {warmup} warm-up rounds, ours, dict and vLLM interleaved")
    print()
    baseline_rows, peer_rows = [], []
    for case in cases:
        ops = [case.op, dict_insert_delete(case.keys)] + ([case.peer.op] if case.peer is not None else [])
        ours, baseline, *peer = _report.time_interleaved(ops, rounds=rounds, warmup=warmup, setup=case.setup_both)
        baseline_rows.append(ratio_row(case, ours, baseline, GOAL_RATIO, 1))
        if peer:
            peer_rows.append(ratio_row(case, ours, peer[0], PEER_GOAL_RATIO, 0))
    _report.print_table(
        ["case", "hits", "ours ns/block", "dict ns/key", "ratio", "(best)", "goal", "result"], baseline_rows)
    print()
    print("ratio = median ours ns/block over median baseline ns/key; result judged on the median ratio")
    print()
    if peer_rows:
        _report.print_table(
            ["case (same rounds as above)", "hits", "ours ns/block", "vLLM ns/block", "ratio", "(best)", "goal",
             "result"], peer_rows)
        print()
        print("ratio = median ours ns/block over median vLLM ns/block; result judged on the median ratio")
    else:
        print(f"vLLM rows skipped: they need vLLM ({why_no_vllm}); "
              "run `.venv-vllm/bin/python benchmarks/bench_block_index.py`")
    return 0


def ratio_row(case: Case, ours: _report.Timings, other: _report.Timings, goal: float,
              digits: int) -> list[object]:
    """One table row: ours and the other side per block (median and best), the ratio, the verdict."""
    ratio = ours.median_ns / other.median_ns
    return [
        case.name,
        f"{case.num_hit_blocks}/{NUM_PROMPT_BLOCKS}",
        _report.median_and_best(ours.median_ns / NUM_PROMPT_BLOCKS, ours.best_ns / NUM_PROMPT_BLOCKS),
        _report.median_and_best(other.median_ns / NUM_PROMPT_BLOCKS, other.best_ns / NUM_PROMPT_BLOCKS, digits),
        f"{ratio:.{1 if goal >= 2 else 2}f}x",
        f"{ours.best_ns / other.best_ns:.{1 if goal >= 2 else 2}f}x",
        f"<= {goal:g}x",
        _report.verdict(ratio <= goal),
    ]


if __name__ == "__main__":
    sys.exit(main())
