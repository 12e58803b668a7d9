"""Layouts sharing the node's host budget: a layout gone idle lets the others take its memory and gets
its fair share back when used again; a layout that leaves gives everything back; never more than the
budget together."""

from __future__ import annotations

import time

from kvtierd.index.slot_entry import BlockMeta
from kvtierd.launch.daemon_process import wait_until
from kvtierd.t1.host_tier import HostTier
from kvtierd.t2.node_budget import NodeBudget
from tests.factories import small_layout

LAYOUT = small_layout()  # 512-byte blocks: one 4 KiB slot each
SLOT = 4096


def settled(tier: HostTier, nbytes: int) -> bool:
    tier.share._wanted.set()  # look now rather than at the next periodic wake
    return tier.capacity_bytes == nbytes


def test_an_idle_layout_lets_the_others_take_its_share_and_gets_it_back_when_used():
    budget = NodeBudget(16 * SLOT, "host")
    a = HostTier(LAYOUT, 0, budget=budget, key="a", idle_s=1000)
    b = HostTier(LAYOUT, 0, budget=budget, key="b", idle_s=1000)
    try:
        assert wait_until(lambda: settled(b, 8 * SLOT), timeout_s=30) and a.capacity_bytes == 8 * SLOT
        now = time.monotonic()
        b.share.follow_activity(now)
        b.share.follow_activity(now + 2000)  # nothing stored into or loaded from b for longer than idle_s
        assert b.share.idle and budget.share("b").share_bytes == 0
        assert wait_until(lambda: settled(a, 16 * SLOT), timeout_s=30)  # a's share is the whole budget now
        assert b.capacity_bytes == 0 and budget.used_bytes == 16 * SLOT

        b.index.prepare_load([BlockMeta(b"\1" * 33, b"\0" * 33, b"").block_hash])  # b is used again
        b.share.follow_activity()
        assert not b.share.idle and budget.share("b").share_bytes == 8 * SLOT
        assert wait_until(lambda: settled(b, 8 * SLOT), timeout_s=30) and a.capacity_bytes == 8 * SLOT
    finally:
        b.close()
        a.close()
    assert budget.used_bytes == 0


def test_a_layout_that_leaves_gives_its_memory_to_the_others():
    budget = NodeBudget(16 * SLOT, "host")
    a = HostTier(LAYOUT, 0, budget=budget, key="a", idle_s=0)
    b = HostTier(LAYOUT, 0, budget=budget, key="b", idle_s=0)
    try:
        assert wait_until(lambda: settled(b, 8 * SLOT), timeout_s=30)
        b.close()
        assert budget.used_bytes == 8 * SLOT
        assert wait_until(lambda: settled(a, 16 * SLOT), timeout_s=30)
    finally:
        a.close()
