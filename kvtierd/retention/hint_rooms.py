"""Which blocks of a chain a new hint may be set on: those the tenant's quota has room for in
every tier the block is in, in chain order (the daemon's Retain, Commit and Put, and the trace
simulator, decide alike)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtierd.daemon_key import DaemonKey
from kvtierd.tier import Tier


def keys_with_room(keys: Sequence[DaemonKey], is_retained: Callable[[DaemonKey], bool],
                   tiers_of: Callable[[DaemonKey], list[Tier]],
                   rooms: dict[Tier, int]) -> tuple[list[DaemonKey], Tier | None]:
    """The keys a hint is set on, and the first tier found at its quota (None if none was).
    A key already retained is renewed without taking room; any other takes one unit of room in
    each tier it is in (`rooms`, the tenant's room per tier for the hint's priority: consumed)
    while every one of them has room left."""
    kept: list[DaemonKey] = []
    full: Tier | None = None
    for key in keys:
        if is_retained(key):
            kept.append(key)
            continue
        where = tiers_of(key)
        over = next((tier for tier in where if rooms[tier] <= 0), None)
        if over is not None:
            full = full or over
            continue
        for tier in where:
            rooms[tier] -= 1
        kept.append(key)
    return kept, full
