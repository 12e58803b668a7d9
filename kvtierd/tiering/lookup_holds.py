"""A Lookup's promise kept until its Acquire: the promised T0 and T1 hits held for a few seconds.

An engine asks what the daemon holds when it schedules a request (Lookup) and loads it a step
later (Acquire); meanwhile other requests' stores evict, and a promised block that is gone is a
failed load the engine must recompute. A Lookup that names a `hold_id` holds the first chain's
promised blocks in T0 (a reference, as a request's) and in T1 (pinned, as a load's) until an
Acquire that names the same `hold_id` has taken them, a Lookup with the same `hold_id` replaces
the hold, or `HOLD_S` passed (a request the engine dropped). LMCache's scheduler-side lookup pins
the chunks it finds until the worker retrieves them the same way (storage_manager.py,
batched_async_contains(..., pin=True)).

Holds are bounded per pool: together at most a quarter of T0's blocks and a quarter of T1's slots
(a hold past that holds fewer leading blocks; the answer is the same). T2 and T3 hits are not held:
T2's reads pin their slots, T3's keys are the store's.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.block_index import BlockIndex
from kvtierd.tier import Tier, TierCounts
from kvtierd.tiering.lower_tier import LowerTier, Segment
from kvtierd.tiering.promotion import Promoter
from kvtierd.token_bytes import TokenBytes

HOLD_S = 5.0  # a hold nobody took lapses after this long
HOLD_SHARE = 4  # holds take at most 1 / HOLD_SHARE of T0's blocks and of T1's slots

HoldKey = tuple[bytes, str]  # (the tenant's tag, the caller's hold_id)


@dataclasses.dataclass
class Hold:
    holder_id: str  # T0's table of the held blocks (BlockIndex.hold_hits); "" when none were held
    num_t0_blocks: int
    t1: Segment | None  # the pinned T1 entries
    expires_at_s: float

    @property
    def num_t1_blocks(self) -> int:
        return len(self.t1.metas) if self.t1 is not None else 0


class LookupHolds:
    """Invariants: `num_t0_blocks` / `num_t1_blocks` are the sums over `holds`, each at most its
    tier's bound; every hold's T0 table and T1 pins are given back exactly once (release,
    replace or expiry)."""

    def __init__(self, index: BlockIndex, promoter: Promoter, t1_capacity_blocks: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index, self.promoter = index, promoter
        self.t1_level: LowerTier | None = promoter.levels_by_tier.get(Tier.T1)
        self.t1_capacity_blocks = t1_capacity_blocks
        self.clock = clock
        self.holds: dict[HoldKey, Hold] = {}
        self.num_t0_blocks = self.num_t1_blocks = 0
        self.num_expired_holds = 0  # holds no Acquire took
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def hold(self, key: HoldKey, block_hashes: list[DaemonKey], token_bytes: TokenBytes | None,
             promised: TierCounts) -> TierCounts:
        """Hold the chain's `promised` leading T0 and T1 blocks under `key` (replacing its hold);
        returns what was held."""
        self.expire()
        with self._lock:  # the one replaced and the new one in one step: two Lookups of a key leak nothing
            replaced = self.holds.pop(key, None)
            if replaced is not None:
                self._give_back(replaced)
            t0_room = self.index.num_blocks // HOLD_SHARE - self.num_t0_blocks
            t1_room = self.t1_capacity_blocks() // HOLD_SHARE - self.num_t1_blocks
            holder_id = f"lookup-hold-{next(self._ids)}"
            num_t0 = self.index.hold_hits(holder_id, block_hashes[:promised.t0], t0_room, token_bytes) \
                if promised.t0 and t0_room > 0 else 0
            t1 = None
            if num_t0 == promised.t0 and promised.t1 and t1_room > 0 and self.t1_level is not None:
                end = num_t0 + min(promised.t1, t1_room)
                t1 = self.promoter.claim_level(self.t1_level, block_hashes[:end], token_bytes, num_t0)
            hold = Hold(holder_id if num_t0 else "", num_t0, t1, self.clock() + HOLD_S)
            if num_t0 or hold.num_t1_blocks:
                self.holds[key] = hold
                self.num_t0_blocks += num_t0
                self.num_t1_blocks += hold.num_t1_blocks
            elif t1 is not None and self.t1_level is not None:
                self.t1_level.release(t1)
            return TierCounts(t0=num_t0, t1=hold.num_t1_blocks)

    def release(self, key: HoldKey) -> bool:
        """Give the hold back (its Acquire took the blocks, or it is replaced); False: none."""
        with self._lock:
            hold = self.holds.pop(key, None)
            if hold is not None:
                self._give_back(hold)
        return hold is not None

    def expire(self) -> int:
        """Give back the holds past their time; how many."""
        now = self.clock()
        with self._lock:
            lapsed = [key for key, hold in self.holds.items() if hold.expires_at_s <= now]
            for key in lapsed:
                self._give_back(self.holds.pop(key))
            self.num_expired_holds += len(lapsed)
        return len(lapsed)

    def release_all(self) -> None:
        """Give every hold back (the pool closes)."""
        with self._lock:
            for hold in self.holds.values():
                self._give_back(hold)
            self.holds.clear()

    def _give_back(self, hold: Hold) -> None:
        if hold.holder_id:
            self.index.free(hold.holder_id)
        if hold.t1 is not None and self.t1_level is not None:
            self.t1_level.release(hold.t1)
        self.num_t0_blocks -= hold.num_t0_blocks
        self.num_t1_blocks -= hold.num_t1_blocks
        assert self.num_t0_blocks >= 0 and self.num_t1_blocks >= 0, "gave back more than was held"
