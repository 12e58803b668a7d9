"""What the vLLM connector's scheduler side hands its worker side for one engine step.

vLLM builds one connector metadata object per step on the scheduler
(`KVConnectorBase_V1.build_connector_meta`, vllm/distributed/kv_transfer/kv_connector/v1/base.py)
and binds it on every worker before the forward (`bind_connector_metadata`); with a
multiprocess executor it is pickled on the way. So these are plain, picklable dataclasses of
ints, bytes and tuples, and import neither vllm nor grpc. connector.py registers
`StepMetadata` as a virtual subclass of vLLM's `KVConnectorMetadata` where vLLM is installed.

Keys are vLLM's own `Request.block_hashes` (one per full block, chained from vLLM's NONE_HASH;
vllm/v1/core/kv_cache_utils.py); the daemon prefixes them with the caller's tenant.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy cached blocks from the daemon into a request's engine blocks: before the forward
    (synchronous), or in the background while vLLM holds the request (`is_async`).

    Invariant: `block_hashes[i]` is the key of chain position `first_block_index + i`, its
    tokens are `token_ids[i * block_size:(i + 1) * block_size]`, and it lands in engine block
    `engine_block_ids[i]`; the three have one entry (one block of tokens) per block.
    """

    request_id: str
    first_block_index: int  # chain position of block_hashes[0]
    block_hashes: tuple[bytes, ...]
    token_ids: tuple[int, ...]
    engine_block_ids: tuple[int, ...]
    is_async: bool = False  # True: loaded in the background, reported in finished_recving

    def __post_init__(self) -> None:
        assert len(self.block_hashes) == len(self.engine_block_ids) > 0, self
        assert len(self.token_ids) % len(self.block_hashes) == 0, self

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


@dataclasses.dataclass(frozen=True, slots=True)
class StoreSpec:
    """Offer a request's full blocks, from chain position 0 to `num_blocks`, to the daemon.

    The chain starts at block 0 because the daemon's Commit needs the root as the parent of a
    request's first block; blocks the daemon already holds come back as hits from Acquire and
    are neither copied nor committed again. Same per-block invariant as LoadSpec.
    `num_new_blocks` counts the trailing blocks this step completed (for logs and tests).
    """

    request_id: str
    block_hashes: tuple[bytes, ...]
    token_ids: tuple[int, ...]
    engine_block_ids: tuple[int, ...]
    num_new_blocks: int

    def __post_init__(self) -> None:
        assert len(self.block_hashes) == len(self.engine_block_ids) > 0, self
        assert len(self.token_ids) % len(self.block_hashes) == 0, self
        assert 0 < self.num_new_blocks <= len(self.block_hashes), self

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


@dataclasses.dataclass(slots=True)
class StepMetadata:
    """One step's work: loads (synchronous ones before the forward, asynchronous ones started
    then), stores (started after the forward, finished in the background), and the requests vLLM
    preempted this step (their blocks are about to be reused: `handle_preemptions` waits for their
    stores). A request appears at most once in each list."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    stores: list[StoreSpec] = dataclasses.field(default_factory=list)
    preempted_req_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert len({spec.request_id for spec in self.loads}) == len(self.loads), "a request loads twice"
        assert len({spec.request_id for spec in self.stores}) == len(self.stores), "a request stores twice"
