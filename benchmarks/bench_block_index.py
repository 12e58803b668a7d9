"""Block index: allocate + commit + free of a 4k-token prompt, per block, beside a dict insert + delete.

One round is what a runner does for one request: `allocate(request, hashes)`, `commit` of every
block that missed (the hits are committed already), `free(request)`. It is timed at 0 %, 50 % and
100 % prefix hits in a pool large enough that nothing is evicted, and at 0 % hits in a pool full
of cached blocks, where every fresh block evicts one. Extra rows: 100 % hits with token
verification (`token_ids` passed to allocate), and token ids as a Python list instead of packed
u32 bytes (the daemon's wire format; a list costs ~7 ns a token to pack).

Baseline: for each of the prompt's 256 hash keys, `d[k] = v; del d[k]` on a plain dict, the
least a hash-keyed index can do per block. Goal: ours <= 8x the baseline (ns/block over ns/key).

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
GOAL_RATIO = 8.0
REQUEST_ID = "bench"

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
    """One row: a timed operation, the setup that restores its starting state, its baseline keys."""

    name: str
    num_hit_blocks: int
    op: Callable[[], object]
    setup: Callable[[], None]
    keys: list[BlockHash]


def fixed_prompt_case(name: str, prompt: Prompt, num_cached_blocks: int,
                      tokens: str = "packed", verify: bool = False) -> Case:
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

    return Case(name, num_cached_blocks, op, setup, prompt.block_hashes)


def evicting_case(rng: np.random.Generator) -> Case:
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

    return Case("0% hits, pool full: each fresh block evicts", 0, op, setup, prompts[0].block_hashes)


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
    rng = np.random.default_rng(20240601)
    prompt = make_prompt(rng)
    cases = [
        fixed_prompt_case("0% hits", prompt, 0),
        fixed_prompt_case("50% hits (first 128 blocks cached)", prompt, NUM_HALF_HIT_BLOCKS),
        fixed_prompt_case("100% hits", prompt, NUM_PROMPT_BLOCKS),
        evicting_case(rng),
        fixed_prompt_case("[extra] 0% hits, token ids as list[int]", prompt, 0, tokens="list"),
        fixed_prompt_case("[extra] 100% hits + token check, packed", prompt, NUM_PROMPT_BLOCKS, verify=True),
        fixed_prompt_case("[extra] 100% hits + token check, list[int]", prompt, NUM_PROMPT_BLOCKS,
                          tokens="list", verify=True),
    ]
    _report.print_header(
        f"Block index: allocate + commit misses + free, {NUM_PROMPT_TOKENS}-token prompt, block {BLOCK_SIZE} "
        f"({NUM_PROMPT_BLOCKS} blocks), pool {NUM_POOL_BLOCKS} blocks, sha256 keys", args.quick)
    print("baseline: dict insert + delete, `d[k] = v; del d[k]` for each of the prompt's 256 keys (ns/key)")
    print(f"goal: ours <= {GOAL_RATIO:g}x baseline; {rounds} rounds each after {warmup} warm-up rounds")
    print()
    rows = []
    for case in cases:
        ours, baseline = _report.time_pair(case.op, dict_insert_delete(case.keys), rounds=rounds, warmup=warmup,
                                           ours_setup=case.setup)
        ratio = ours.median_ns / baseline.median_ns
        rows.append([
            case.name,
            f"{case.num_hit_blocks}/{NUM_PROMPT_BLOCKS}",
            _report.median_and_best(ours.median_ns / NUM_PROMPT_BLOCKS, ours.best_ns / NUM_PROMPT_BLOCKS),
            _report.median_and_best(baseline.median_ns / NUM_PROMPT_BLOCKS, baseline.best_ns / NUM_PROMPT_BLOCKS,
                                    1),
            f"{ratio:.1f}x",
            f"{ours.best_ns / baseline.best_ns:.1f}x",
            f"<= {GOAL_RATIO:g}x",
            _report.verdict(ratio <= GOAL_RATIO),
        ])
    _report.print_table(
        ["case", "hits", "ours ns/block", "dict ns/key", "ratio", "(best)", "goal", "result"], rows)
    print()
    print("ratio = median ours ns/block over median baseline ns/key; result judged on the median ratio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
