"""A node's budget of one resource (T1 host memory, T2 disk), shared by the layouts' tiers.

`host.capacity_bytes` and `ssd.capacity_bytes` are the node's, not a layout's: every layout's
tier takes its bytes from one NodeBudget, so the sum over layouts never exceeds the budget.

Holders are keyed (a layout's T2 directory, a layout id for T1). `reserve` takes bytes (all or,
with `unit`, as many whole units as are free), `release` gives them back. A holder may register
a `shed(nbytes)` callback: `make_room(key, nbytes)` asks the holder furthest above its fair
share (capacity / active holders) to give bytes back when `key` is below its own share and the
budget is full, so that a layout attached late is not starved by one that filled the disk first.
A holder at or above its share evicts its own blocks instead (the caller's business).

Dormant holders stand for what a layout left on disk before a restart (its slot files) before
that layout attaches again: their share is 0, so they give back first; `register` of the same
key adopts the bytes. A shed callback runs outside the budget's lock (it does I/O) and releases
what it gave back itself; `register` and `unregister` wait for a shed of their key in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable

from kvtierd.units import ALIGNMENT_BYTES

log = logging.getLogger(__name__)

Shed = Callable[[int], int]  # (bytes asked) → bytes given back (already released)


@dataclasses.dataclass(slots=True)
class _Holder:
    held_bytes: int = 0
    shed: Shed | None = None
    active: bool = True  # False: dormant (files of a layout not attached since the restart)
    num_shedding: int = 0  # shed callbacks in flight


@dataclasses.dataclass(frozen=True, slots=True)
class BudgetShare:
    """One holder's part of a node budget, for stats."""

    held_bytes: int  # what the holder takes now (T1: its slab; T2: its slot files)
    share_bytes: int  # its fair share: capacity / active holders (T1: its slab, fixed at attach)
    node_capacity_bytes: int  # the node's budget
    node_used_bytes: int  # what every holder together takes


class NodeBudget:
    """Thread-safe. Invariant: the sum of `held_bytes` over holders is `used_bytes`, and
    `reserve` never takes it above `capacity_bytes` (dormant holders registered above it, after
    the budget was lowered, are shed first)."""

    def __init__(self, capacity_bytes: int, name: str = "") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.name = name
        self._holders: dict[str, _Holder] = {}
        self._used_bytes = 0
        self._changed = threading.Condition()

    # ------------------------------------------------------------------------- holders

    def register(self, key: str, shed: Shed | None = None) -> int:
        """Make `key` an active holder; returns the bytes it already holds (a dormant holder's
        files, adopted), 0 for a new one."""
        with self._changed:
            holder = self._holders.get(key)
            if holder is None:
                holder = self._holders[key] = _Holder()
            self._changed.wait_for(lambda: holder.num_shedding == 0)
            holder.shed, holder.active = shed, True
            return holder.held_bytes

    def add_dormant(self, key: str, held_bytes: int, shed: Shed) -> None:
        """Bytes a layout not attached yet holds on disk (they count before it attaches)."""
        with self._changed:
            assert key not in self._holders, key
            self._holders[key] = _Holder(held_bytes, shed, active=False)
            self._used_bytes += held_bytes

    def make_dormant(self, key: str, shed: Shed) -> None:
        """The holder closed but its bytes stay (its files are on disk): it keeps them with a
        share of 0 until `register` adopts them again or `shed` gives them back."""
        with self._changed:
            holder = self._holders[key]
            self._changed.wait_for(lambda: holder.num_shedding == 0)
            holder.shed, holder.active = shed, False

    def unregister(self, key: str) -> None:
        """The holder is gone (its tier closed): its bytes are free. Waits for its shed in flight."""
        with self._changed:
            holder = self._holders.get(key)
            if holder is None:
                return
            self._changed.wait_for(lambda: holder.num_shedding == 0)
            del self._holders[key]
            self._used_bytes -= holder.held_bytes
            self._changed.notify_all()

    # ------------------------------------------------------------------------- bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self._used_bytes)

    def held_bytes(self, key: str) -> int:
        with self._changed:
            holder = self._holders.get(key)
            return holder.held_bytes if holder is not None else 0

    def reserve(self, key: str, nbytes: int, unit: int = 0) -> int:
        """Take `nbytes` for `key`: all of them, or 0; with `unit`, as many whole units of
        `unit` bytes as are free, up to `nbytes`. Returns the bytes taken."""
        assert nbytes >= 0
        with self._changed:
            holder = self._holders[key]
            free = self.free_bytes
            granted = nbytes if nbytes <= free else (free // unit * unit if unit else 0)
            holder.held_bytes += granted
            self._used_bytes += granted
            return granted

    def release(self, key: str, nbytes: int) -> None:
        with self._changed:
            holder = self._holders[key]
            assert 0 <= nbytes <= holder.held_bytes, (key, nbytes, holder.held_bytes)
            holder.held_bytes -= nbytes
            self._used_bytes -= nbytes
            self._changed.notify_all()

    def share(self, key: str) -> BudgetShare:
        with self._changed:
            holder = self._holders.get(key)
            return BudgetShare(holder.held_bytes if holder else 0, self._fair_share(holder) if holder else 0,
                               self.capacity_bytes, self._used_bytes)

    # ------------------------------------------------------------------------- fairness

    def make_room(self, key: str, nbytes: int, needed_bytes: int | None = None, max_rounds: int = 4) -> int:
        """Before `key` reserves `nbytes`: when the budget lacks them and `key` holds less than
        its fair share, ask the holders furthest above theirs to give back (never more than
        takes them down to their share, or `key` up to its own). A dormant holder gives only
        what `key` needs now (`needed_bytes`, default `nbytes`): its layout may attach again
        and find its blocks. Returns the bytes given back. Call it holding none of the holders'
        locks (a shed takes its holder's)."""
        needed_bytes = nbytes if needed_bytes is None else needed_bytes
        given = 0
        for _ in range(max_rounds):
            with self._changed:
                holder = self._holders[key]
                missing = min(nbytes - self.free_bytes, self._fair_share(holder) - holder.held_bytes)
                victim_key, excess = self._furthest_above_share(key)
                if missing <= 0 or victim_key is None:
                    return given
                victim = self._holders[victim_key]
                if not victim.active:
                    missing = min(missing, needed_bytes - self.free_bytes)
                    if missing <= 0:
                        return given
                victim.num_shedding += 1
                shed, amount = victim.shed, min(missing, excess)
            try:
                gave = shed(amount) if shed is not None else 0
            finally:
                with self._changed:
                    victim.num_shedding -= 1
                    self._changed.notify_all()
            given += gave
            if gave <= 0:
                return given
        return given

    def shed_over_capacity(self) -> None:
        """After dormant holders were registered above a lowered capacity: shed them down to it."""
        while True:
            with self._changed:
                over = self._used_bytes - self.capacity_bytes
                victim_key, excess = self._furthest_above_share(None)
                if over <= 0 or victim_key is None:
                    return
                victim = self._holders[victim_key]
                victim.num_shedding += 1
                shed = victim.shed
            try:
                gave = shed(min(over, excess)) if shed is not None else 0
            finally:
                with self._changed:
                    victim.num_shedding -= 1
                    self._changed.notify_all()
            if gave <= 0:
                return

    def _fair_share(self, holder: _Holder) -> int:
        if not holder.active:
            return 0
        num_active = sum(1 for h in self._holders.values() if h.active)
        return self.capacity_bytes // max(1, num_active)

    def _furthest_above_share(self, asking: str | None) -> tuple[str | None, int]:
        best_key, best_excess = None, 0
        for key, holder in self._holders.items():
            if key == asking or holder.shed is None or holder.num_shedding:
                continue
            excess = holder.held_bytes - self._fair_share(holder)
            if excess > best_excess:
                best_key, best_excess = key, excess
        return best_key, best_excess


def truncating_shed(budget: NodeBudget, key: str, paths: list[str]) -> Shed:
    """The shed of a dormant holder whose bytes are `paths` (a closed layout's slot files): cut the
    files from the end (the layout drops the records past its files when it opens them again)."""

    def shed(nbytes: int) -> int:
        given = 0
        for path in paths:
            try:
                size = os.path.getsize(path)
                cut = min(size, -(-(nbytes - given) // ALIGNMENT_BYTES) * ALIGNMENT_BYTES)
                os.truncate(path, size - cut)
            except OSError as error:
                log.warning("giving back %s of disk failed: %s", path, error)
                continue
            given += cut
            if given >= nbytes:
                break
        released = min(given, budget.held_bytes(key))
        budget.release(key, released)
        return released

    return shed
