"""What the vLLM connector's scheduler side hands its worker side for one engine step.

vLLM builds one connector metadata object per step on the scheduler
(`KVConnectorBase_V1.build_connector_meta`, vllm/distributed/kv_transfer/kv_connector/v1/base.py)
and binds it on every worker before the forward (`bind_connector_metadata`); with a
multiprocess executor it is pickled on the way. So these are plain, picklable dataclasses of
ints, bytes and tuples, and import neither vllm nor grpc. connector.py registers
`StepMetadata` as a virtual subclass of vLLM's `KVConnectorMetadata` where vLLM is installed.

Keys are the groups' keys (kv_groups.group_block_hash of vLLM's own `Request.block_hashes`);
the daemon prefixes them with the caller's tenant. Everything is per KV cache group: a model
with one group has one GroupBlocks per spec.
"""

from __future__ import annotations

import dataclasses

from kvtierd.connectors.vllm.retention_hints import PromptRetention


@dataclasses.dataclass(frozen=True, slots=True)
class GroupBlocks:
    """Blocks of one KV cache group: the daemon's chain of them and the engine blocks they are in.

    Invariant: `block_hashes[i]`'s tokens are `token_ids[i * block_size:(i + 1) * block_size]` and
    it is engine block `engine_block_ids[i]`; `block_hashes[0]` is chain position `first_position`.
    """

    group_id: int
    first_position: int
    block_hashes: tuple[bytes, ...]
    token_ids: tuple[int, ...]
    engine_block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.block_hashes) == len(self.engine_block_ids) > 0, self
        assert len(self.token_ids) % len(self.block_hashes) == 0, self

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    def then(self, later: GroupBlocks) -> GroupBlocks:
        """These blocks followed by `later`, the blocks right after them in the same group."""
        assert later.group_id == self.group_id and later.first_position == self.first_position + self.num_blocks
        return GroupBlocks(self.group_id, self.first_position, self.block_hashes + later.block_hashes,
                           self.token_ids + later.token_ids, self.engine_block_ids + later.engine_block_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy cached blocks from the daemon into a request's engine blocks, group by group: before
    the forward (synchronous), or in the background while vLLM holds the request (`is_async`).
    Each group's blocks are a chain the daemon is asked for as a whole."""

    request_id: str
    groups: tuple[GroupBlocks, ...]
    is_async: bool = False  # True: loaded in the background, reported in finished_recving

    def __post_init__(self) -> None:
        assert self.groups, self

    @property
    def num_blocks(self) -> int:
        return sum(group.num_blocks for group in self.groups)

    @property
    def engine_block_ids(self) -> tuple[int, ...]:
        return tuple(block_id for group in self.groups for block_id in group.engine_block_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class GroupStore:
    """Offer one group's blocks completed this step, after the one block the daemon holds before them.

    `blocks` is the trailing `num_new_blocks` (the new ones) after at most one block stored or
    loaded before (their parent: the daemon's Acquire of it proves the chain reaches them, and
    its hash is the parent the Commit names); a chain that starts at position 0 has no such block
    (its parent is the root), a Mamba state is a chain of one. New blocks the daemon already
    holds come back as hits from Acquire and are neither copied nor committed again. When the
    daemon lacks the parent, `earlier` (the blocks before `blocks`, from position 0: on a
    request's first store, when its chain begins with blocks of vLLM's own cache) is stored with
    them; without `earlier` the offer is dropped. `volatile` (sliding window, Mamba): only the
    new blocks are sure to be in the engine still (vLLM frees the others next step).
    """

    blocks: GroupBlocks
    num_new_blocks: int
    volatile: bool = False
    earlier: GroupBlocks | None = None

    def __post_init__(self) -> None:
        assert 0 < self.num_new_blocks <= self.blocks.num_blocks, self
        assert self.num_known_blocks <= 1, self
        assert self.earlier is None or (self.earlier.first_position == 0 and not self.volatile), self

    @property
    def num_known_blocks(self) -> int:
        """Leading blocks of `blocks` the daemon was given before (0 or 1: the parent)."""
        return self.blocks.num_blocks - self.num_new_blocks


@dataclasses.dataclass(frozen=True, slots=True)
class StoreSpec:
    """One request's offers this step, one per group with newly completed blocks; `retention`: the
    request's hint (retention_hints.py), which each Commit carries over the new blocks it covers."""

    request_id: str
    groups: tuple[GroupStore, ...]
    retention: PromptRetention | None = None

    def __post_init__(self) -> None:
        assert self.groups, self

    @property
    def num_new_blocks(self) -> int:
        return sum(group.num_new_blocks for group in self.groups)


@dataclasses.dataclass(frozen=True, slots=True)
class RetainSpec:
    """Renew a request's hint on the blocks the daemon held before the request's own stores (a
    second turn's shared prefix, vLLM's own hits, a load) with one Retain per chain, sent after the
    step's stores. `chains`: per group, its keys of chain positions 0 to the last the hint covers
    (the daemon acts on the leading ones it holds)."""

    request_id: str
    retention: PromptRetention
    chains: tuple[tuple[bytes, ...], ...]

    def __post_init__(self) -> None:
        assert self.chains and all(self.chains), self


@dataclasses.dataclass(slots=True)
class StepMetadata:
    """One step's work: loads (synchronous ones before the forward, asynchronous ones started
    then), stores (started after the forward, finished in the background), the requests vLLM
    preempted this step (their blocks are about to be reused: `handle_preemptions` waits for their
    stores), and the retention hints to renew after the stores. A request appears at most once in
    each list. The token counts tell the worker how much of the step's forward is prefill
    (forward_timing.py)."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    stores: list[StoreSpec] = dataclasses.field(default_factory=list)
    preempted_req_ids: tuple[str, ...] = ()
    num_scheduled_tokens: int = 0  # every token the step's forward computes
    num_prefill_tokens: int = 0  # of those, the tokens of requests still in their prompt
    retains: list[RetainSpec] = dataclasses.field(default_factory=list)  # sent after this step's stores

    def __post_init__(self) -> None:
        assert len({spec.request_id for spec in self.loads}) == len(self.loads), "a request loads twice"
        assert len({spec.request_id for spec in self.stores}) == len(self.stores), "a request stores twice"
        assert len({spec.request_id for spec in self.retains}) == len(self.retains), "a request retains twice"
