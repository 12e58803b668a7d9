"""A layout's part of the node's host budget: its host tier's extent follows demand and fairness.

`host.capacity_bytes` is the node's (a NodeBudget, t2/node_budget.py). A layout's T1 takes from it:
- at start, its fair share (the budget over the layouts with T1) or what is free of it;
- past that, whenever its T1 had to evict for want of a free slot and the budget has bytes free, a
  step more (`growth_step_bytes`), so one layout alone grows to the whole budget;
- when it holds less than its fair share and the budget is spent, it asks the layout furthest above
  its share to give back (`NodeBudget.make_room` -> that layout's `shed`), which evicts its own least
  recently used blocks, moves the blocks it keeps out of the end of its slab (a host memcpy), and
  gives the end's memory back. Blocks that a load or a store holds never move; the shed stops above
  them.
A layout whose T1 was neither stored into nor loaded from for `idle_s` turns idle: its fair share is
0 (NodeBudget's dormant holder) and it gives back what another layout needs now, keeping its blocks
until then; its next store or load makes it active again, with its fair share.
Growing commits the slab's pages (with CUDA: touches and page-locks them grain by grain, T1 serving
each grain as it lands) on the share's own thread; a shed runs on the asking layout's thread. Neither
holds its lock while asking the budget for room, so two layouts growing at once cannot deadlock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtierd.errors import ResourceExhausted
from kvtierd.index.extent_slot_index import ExtentSlotIndex
from kvtierd.index.slot_entry import SlotEntry
from kvtierd.movers.span_copy import copy_rows
from kvtierd.t1.host_slab import HostSlab
from kvtierd.t2.node_budget import BudgetShare, NodeBudget
from kvtierd.units import GiB

log = logging.getLogger(__name__)

GROWTH_FRACTION = 16  # a growth step past the fair share: the budget / this, at least a grain
WAKE_S = 5.0  # the share's thread looks again at least this often (a peer may have left room)


class HostShare:
    """Sizes one layout's T1 extent by its part of the node's host budget.

    Invariants: outside a resize, `budget.held_bytes(key)` == `slab.nbytes` and `index.num_slots`
    == `slab.num_ready_slots`; one resize (grow or shed) at a time (`_resize`); a shed never moves
    or drops a block a load or a store holds.
    """

    def __init__(self, slab: HostSlab, index: ExtentSlotIndex, budget: NodeBudget, key: str,
                 idle_s: float = 0.0) -> None:
        assert index.max_slots == slab.max_slots and index.num_slots == slab.num_ready_slots == 0
        self.slab, self.index, self.budget, self.key = slab, index, budget, key
        self.grain_bytes = slab.grain_slots * slab.stride
        self.growth_step_bytes = max(self.grain_bytes, budget.capacity_bytes // GROWTH_FRACTION)
        self.growing = False  # extending the slab now (with CUDA: pinning)
        self._evictions_seen = 0  # index.num_evictions when the share last grew: more since = demand
        self.idle_s = idle_s  # 0: never idle
        self.idle = False  # dormant in the budget: share 0, gives back what others need
        self._uses_seen = (-1, time.monotonic())  # (index.num_uses, when it was last seen to change)
        self._resize = threading.Lock()
        self._wanted = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvtierd-t1-share", daemon=True)
        budget.register(key, self.shed)
        index.on_evicting = self._wanted.set  # under the index lock: only sets the event
        # sees the blocks a shed evicts, bytes intact, before the kept ones move over them (the
        # offloader spills them down as any T1 victim: on_evict edges, retained blocks); set once
        self.on_shed_evicted: Callable[[list[SlotEntry]], None] | None = None

    def start(self) -> None:
        """Take the fair share, or what is free of it: at once where that only commits pages (no CUDA);
        with CUDA its first grain at once and the rest on the share's thread (pinning takes ~0.3 s a
        GiB), T1 serving each grain as it lands; then follow demand on that thread."""
        self.grow(ask_room=False, max_bytes=self.grain_bytes if self.slab.pinned else None)
        self._wanted.set()
        self._thread.start()

    @property
    def share(self) -> BudgetShare:
        return self.budget.share(self.key)

    def _run(self) -> None:
        while True:
            self._wanted.wait(min(WAKE_S, self.idle_s / 2) if self.idle_s else WAKE_S)
            self._wanted.clear()
            if self._stopped:
                return
            try:
                self.follow_activity()
                self.grow()
            except Exception:  # the share stays as it is; the next wake tries again
                log.exception("T1 of %s: growing its share failed", self.slab.what)

    def follow_activity(self, now: float | None = None) -> None:
        """Turn idle after `idle_s` without a store or load (the budget's dormant holder: share 0), and
        active again at the next one."""
        now = time.monotonic() if now is None else now
        uses, since = self._uses_seen
        if self.index.num_uses != uses:
            self._uses_seen = (self.index.num_uses, now)
            if self.idle:
                self.budget.register(self.key, self.shed)
                self.idle = False
                log.info("T1 of %s: in use again, its fair share back", self.slab.what)
        elif self.idle_s and not self.idle and now - since >= self.idle_s:
            self.budget.make_dormant(self.key, self.shed)
            self.idle = True
            log.info("T1 of %s: idle for %.0f s, its share open to the other layouts", self.slab.what, now - since)

    def wanted_bytes(self) -> int:
        """How many more bytes this layout should hold now: up to its fair share, and a step past it
        while its T1 evicts and the budget has bytes free."""
        if self.idle:
            return 0
        share = self.share
        if share.held_bytes < share.share_bytes:
            return share.share_bytes - share.held_bytes
        if self.budget.free_bytes and self.index.num_slots < self.slab.max_slots and \
                self.index.num_evictions > self._evictions_seen:
            return self.growth_step_bytes
        return 0

    def grow(self, ask_room: bool = True, max_bytes: int | None = None) -> int:
        """Reserve what `wanted_bytes` says (asking a layout above its share to give back first when
        `ask_room` and this one is below its own) and extend the slab over it; returns the bytes
        added; at most `max_bytes`. Blocking (commits, with CUDA pins)."""
        wanted = min(self.wanted_bytes(), self.slab.max_nbytes - self.slab.nbytes)
        if max_bytes is not None:
            wanted = min(wanted, max_bytes)
        if wanted <= 0:
            return 0
        wanted = -(-wanted // self.grain_bytes) * self.grain_bytes
        share = self.share
        if ask_room and self.budget.free_bytes < wanted and share.held_bytes < share.share_bytes:
            self.budget.make_room(self.key, wanted, needed_bytes=min(wanted, share.share_bytes - share.held_bytes))
        granted = self.budget.reserve(self.key, wanted, unit=self.grain_bytes)
        self._evictions_seen = self.index.num_evictions
        if not granted:
            return 0
        with self._resize:
            before = self.slab.nbytes
            self.growing = True
            try:
                self.slab.extend_to(self.slab.num_ready_slots + granted // self.slab.stride, self._index_to)
            except (ResourceExhausted, RuntimeError) as error:  # /dev/shm full, a registration refused
                log.error("T1 of %s: could not take %.1f MiB more: %s", self.slab.what, granted / 2**20, error)
            finally:
                self.growing = False
                added = self.slab.nbytes - before
                if added < granted:
                    self.budget.release(self.key, granted - added)
        if self.slab.pinned and added:
            log.info("T1 of %s: %.2f GiB page-locked", self.slab.what, self.slab.nbytes / GiB)
        return added

    def _index_to(self, num_ready_slots: int) -> None:
        """The slab holds memory up to `num_ready_slots`: the index may hand those slots out."""
        self.index.grow(num_ready_slots - self.index.num_slots)

    def shed(self, nbytes: int) -> int:
        """Give back at least `nbytes` (whole grains) to the budget, for a layout below its share:
        evict this layout's least recently used blocks, move the kept ones out of the end, give the
        end's memory back. Fewer when loads or stores hold blocks near the end. Returns the bytes
        released (NodeBudget's shed callback)."""
        with self._resize:
            before = self.slab.num_ready_slots
            num_slots = -(-nbytes // self.slab.stride)
            target = max(0, before - -(-num_slots // self.slab.grain_slots) * self.slab.grain_slots)
            shrink = self.index.plan_shrink(target, self.slab.grain_slots)
            moves, moved = shrink.moves, False
            slots = self.slab.slots
            assert slots is not None, "a closed tier is not in the budget"
            try:
                self._spill(shrink.evicted)
                copy_rows(slots, [new for _, _, new in moves], slots, [old for _, old, _ in moves])
                moved = True
            finally:
                self.index.finish_shrink(shrink, moved)
            self.slab.shrink_to(self.index.num_slots)
            assert self.slab.num_ready_slots == self.index.num_slots
            given = (before - self.slab.num_ready_slots) * self.slab.stride
        self.budget.release(self.key, given)
        if given:
            log.info("T1 of %s: gave back %.1f MiB (%d blocks evicted, %d moved)", self.slab.what, given / 2**20,
                     len(shrink.evicted), len(moves))
        return given

    def _spill(self, evicted: list[SlotEntry]) -> None:
        if evicted and self.on_shed_evicted is not None:
            try:
                self.on_shed_evicted(evicted)
            except Exception:  # a failed spill loses those blocks, not the shrink
                log.exception("T1 of %s: spilling %d blocks a shed evicted failed", self.slab.what, len(evicted))

    def close(self) -> None:
        """Stop following demand; give every byte back."""
        self._stopped = True
        self._wanted.set()
        if self._thread.ident is not None:
            self._thread.join()
        self.index.on_evicting = None
        self.budget.unregister(self.key)
