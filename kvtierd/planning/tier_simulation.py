"""A request trace through an engine's prefix cache and kvtierd's tiers, without an engine or bytes.

Replays `TraceRequest`s (request_trace.py) in time order on a simulated clock, as the vLLM
connector and the daemon treat them, with the daemon's own eviction orders and retention classes
(`ClassedLru` over a `HintTable` on the simulated clock), so eviction policies and hints can be
compared at scale in seconds:

- at a request's start, the engine's own prefix cache (vLLM's: `engine_blocks`, of which the
  running requests hold theirs, the rest an LRU of cached blocks; engine_cache.py) serves its
  leading blocks; kvtierd is asked for the blocks after those, and serves the leading run it
  holds in any tier (counted in the highest tier that holds each block). A block served from T1
  or T2 is promoted into T0; a hinted request renews its hint on the blocks kvtierd holds;
- at its end, the engine caches its prompt's blocks, and the blocks kvtierd lacks are stored in
  T0 (with the request's hint): T0 → T1 on eviction or write-through, T1 → T2 write-through, as
  the edge policies say; a retained block leaving a tier is written to the tier below whatever
  the policy (demoted), as the daemon does. A request's blocks enter a tier's order tail first
  (stores and hits alike), so a chain's blocks leave tail first, as in the daemon.

What it leaves out: requests the engine would queue for want of blocks (their send time is their
start), decoded tokens past one block (a few per request in an agent's turn), and the
load-versus-recompute decision (every hit is loaded).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

import xxhash

from kvtierd.daemon_key import TAG_BYTES, DaemonKey, tenant_tag_of
from kvtierd.index.classed_lru import ClassedLru
from kvtierd.index.slot_entry import BlockMeta, SlotEntry
from kvtierd.planning.engine_cache import EngineCache
from kvtierd.planning.request_trace import TraceRequest
from kvtierd.retention.hint import Priority
from kvtierd.retention.hint_rooms import keys_with_room
from kvtierd.retention.hint_table import HintTable
from kvtierd.retention.tier_retention import TierRetention
from kvtierd.tier import Tier
from kvtierd.tiering.tier_config import EdgePolicy
from kvtierd.token_bytes import NO_TOKENS

SIM_TAG = bytes(TAG_BYTES)  # one tenant: every key has the same tag
LOWER_TIERS = (Tier.T0, Tier.T1, Tier.T2)


@dataclasses.dataclass(frozen=True, slots=True)
class SimTiers:
    """Capacities in blocks and the policies of one simulated node; `kvtierd=False` is the engine alone."""

    block_size: int
    engine_blocks: int  # the engine's own prefix cache (vLLM's KV cache)
    t0_blocks: int = 0
    t1_blocks: int = 0
    t2_blocks: int = 0
    kvtierd: bool = True
    eviction: str = "lru"  # every tier's order for blocks without a live hint
    hints: bool = True  # honour the hints the trace carries
    t0_to_t1: EdgePolicy = EdgePolicy.ON_EVICT
    t1_to_t2: EdgePolicy = EdgePolicy.WRITE_THROUGH
    max_tenant_share: float = 0.5  # [retention] max_tenant_share

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.engine_blocks < 0 or min(self.t0_blocks, self.t1_blocks, self.t2_blocks) < 0:
            raise ValueError("a block size of at least 1 token and capacities of 0 or more blocks")
        if self.kvtierd and self.t0_blocks < 1:
            raise ValueError("kvtierd needs a T0 of at least one block")


@dataclasses.dataclass(slots=True)
class GroupCounts:
    """Prompt and hit tokens of a group of requests."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_hit_tokens: int = 0  # the engine's own hits and kvtierd's

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


@dataclasses.dataclass(slots=True)
class SimResult:
    """What a trace did on the simulated node."""

    num_engine_hit_tokens: int = 0
    tier_hit_tokens: dict[Tier, int] = dataclasses.field(
        default_factory=lambda: {tier: 0 for tier in LOWER_TIERS})
    num_unbounded_hit_tokens: int = 0  # an unbounded cache: every block seen before is a hit
    groups: dict[str, GroupCounts] = dataclasses.field(default_factory=lambda: collections.defaultdict(GroupCounts))
    num_demoted_blocks: int = 0

    @property
    def all(self) -> GroupCounts:
        return self.groups["all"]

    @property
    def num_kvtierd_hit_tokens(self) -> int:
        return sum(self.tier_hit_tokens.values())


class SimTier:
    """One tier's blocks in the daemon's eviction order (ClassedLru), at most `capacity_blocks`."""

    def __init__(self, tier: Tier, capacity_blocks: int, eviction: str, table: HintTable | None,
                 max_tenant_share: float) -> None:
        self.tier = tier
        self.capacity_blocks = capacity_blocks
        self.order = ClassedLru()
        self.order.set_eviction(eviction)
        if table is not None:
            limit = max(0, int(max_tenant_share * capacity_blocks))
            self.order.set_retention(TierRetention(tier, table, lambda: limit))
            table.add_listener(self.order.reclassify)

    def __contains__(self, key: DaemonKey) -> bool:
        return key in self.order

    def touch(self, key: DaemonKey) -> None:
        """A hit: the block leaves the evictable set while it is read and comes back."""
        entry = self.order.pop(key)
        assert entry is not None, "only a held block is touched"
        self.order[key] = entry

    def insert(self, key: DaemonKey) -> list[DaemonKey]:
        """Store `key` (a touch when held); returns the victims that made room, newest hint first."""
        if key in self.order:
            self.touch(key)
            return []
        victims = []
        while len(self.order) >= self.capacity_blocks:
            victim, _ = self.order.popitem(last=False)
            victims.append(victim)
        self.order[key] = SlotEntry(BlockMeta(key, key, NO_TOKENS), slot=0, storing=False)
        return victims


class TierSimulation:
    """Replays a trace on one SimTiers; `run` returns what it did."""

    def __init__(self, tiers: SimTiers) -> None:
        self.config = tiers
        self.now_s = 0.0
        self.table = HintTable(clock=lambda: self.now_s) if tiers.hints else None
        self.engine = EngineCache(tiers.engine_blocks)
        capacities = (tiers.t0_blocks, tiers.t1_blocks, tiers.t2_blocks) if tiers.kvtierd else (0, 0, 0)
        self.tiers = [SimTier(tier, capacity, tiers.eviction, self.table, tiers.max_tenant_share)
                      for tier, capacity in zip(LOWER_TIERS, capacities) if capacity > 0]
        self.result = SimResult()
        self._seen: set[DaemonKey] = set()
        self._hinted_sessions: set[int] = set()  # sessions that sent a hint (a session's last turn sends none)

    def run(self, requests: Sequence[TraceRequest]) -> SimResult:
        """Every request's start and end, in time order (at the same time: ends of earlier requests,
        then starts, then the ends of requests that took no time)."""
        events = sorted([(r.start_s, 1, i) for i, r in enumerate(requests)] +
                        [(r.end_s, 0 if r.end_s > r.start_s else 2, i) for i, r in enumerate(requests)])
        keys = [self.chain_keys(r.prompt_token_ids) for r in requests]
        self._hinted_sessions = {r.session for r in requests if r.hint_ttl_s}
        for time_s, kind, i in events:
            self.now_s = time_s
            if self.table is not None:
                self.table.expire()
            if kind == 1:
                self._start(requests[i], keys[i])
            else:
                self._end(requests[i], keys[i])
        return self.result

    def chain_keys(self, token_ids: Sequence[int]) -> list[DaemonKey]:
        """The parent-chained keys of the prompt's blocks a lookup may hit: full blocks, the last
        token left to compute (as the engine asks)."""
        block_size = self.config.block_size
        num_blocks = (len(token_ids) - 1) // block_size
        keys, parent = [], b""
        for i in range(num_blocks):
            tokens = token_ids[i * block_size:(i + 1) * block_size]
            parent = xxhash.xxh3_128_digest(parent + b"".join(t.to_bytes(4, "little") for t in tokens))
            keys.append(DaemonKey(SIM_TAG + parent))
        return keys

    # ------------------------------------------------------------------ a request's start

    def _start(self, request: TraceRequest, keys: list[DaemonKey]) -> None:
        block_size = self.config.block_size
        num_local = self.engine.start(keys)
        num_unbounded = next((i for i, key in enumerate(keys) if key not in self._seen), len(keys))
        served = self._served(keys[num_local:])
        if request.hint_ttl_s and self.table is not None:  # the connector's Retain renews what kvtierd holds
            held = [key for key in keys if any(key in tier for tier in self.tiers)]
            self._retain(held, request)
        hits = list(zip(keys[num_local:], served))
        for key, tier in reversed(hits):  # every served block is held at once (acquired), tail first
            self.result.tier_hit_tokens[tier.tier] += block_size
            tier.touch(key)
        for key, tier in reversed(hits):  # then the lower ones promoted, tail first
            if key not in self.tiers[0]:
                self._store(key, 0)
        num_hit_tokens = (num_local + len(served)) * block_size
        self.result.num_engine_hit_tokens += num_local * block_size
        self.result.num_unbounded_hit_tokens += num_unbounded * block_size
        for group in self._groups(request):
            counts = self.result.groups[group]
            counts.num_requests += 1
            counts.num_prompt_tokens += len(request.prompt_token_ids)
            counts.num_hit_tokens += num_hit_tokens

    def _retain(self, keys: list[DaemonKey], request: TraceRequest) -> None:
        """Set the request's hint on `keys` as the daemon does (hint_rooms.py: within the tenant's
        room for its priority in every tier a block is in)."""
        table = self.table
        assert table is not None
        if not keys:
            return
        priority = Priority(request.hint_priority)
        rooms = {}
        for tier in self.tiers:
            assert tier.order.retention is not None
            rooms[tier.tier] = tier.order.retention.room_for(tenant_tag_of(keys[0]), priority)
        kept, _ = keys_with_room(keys, table.is_retained, lambda key: [t.tier for t in self.tiers if key in t], rooms)
        table.set(kept, f"s{request.session}", priority, request.hint_ttl_s)

    def _groups(self, request: TraceRequest) -> Iterable[str]:
        yield "all"
        yield "first turns" if request.turn == 0 else "resumed turns"
        yield "hinted sessions" if request.session in self._hinted_sessions else "unhinted sessions"

    def _served(self, keys: list[DaemonKey]) -> list[SimTier]:
        """The tier that serves each of the leading blocks kvtierd holds."""
        served = []
        for key in keys:
            tier = next((tier for tier in self.tiers if key in tier), None)
            if tier is None:
                break
            served.append(tier)
        return served

    # ------------------------------------------------------------------ a request's end

    def _end(self, request: TraceRequest, keys: list[DaemonKey]) -> None:
        self.engine.finish(keys)
        self._seen.update(keys)
        if not self.tiers:
            return
        for key in reversed(keys):  # tail first, as T0 frees a request's blocks
            if not any(key in tier for tier in self.tiers):
                self._store(key, 0)
        if request.hint_ttl_s and self.table is not None:  # the stores' Commits carry the hint
            self._retain(keys, request)

    def _store(self, key: DaemonKey, level: int) -> None:
        """Store `key` in tiers[level], and down the write-through edges; victims go down as the
        edge policies and their hints say."""
        if level >= len(self.tiers):
            return
        tier = self.tiers[level]
        victims = tier.insert(key)
        if self._edge(level) is EdgePolicy.WRITE_THROUGH:
            self._store(key, level + 1)
        for victim in victims:
            retained = self.table is not None and self.table.priority(victim) is not Priority.NONE
            if retained or self._edge(level) is EdgePolicy.ON_EVICT:
                below = self.tiers[level + 1] if level + 1 < len(self.tiers) else None
                if below is not None and victim not in below:
                    self.result.num_demoted_blocks += retained
                    self._store(victim, level + 1)

    def _edge(self, level: int) -> EdgePolicy:
        if level == 0:
            return self.config.t0_to_t1
        return self.config.t1_to_t2 if level == 1 else EdgePolicy.OFF
