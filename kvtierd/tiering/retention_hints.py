"""Retention hints on a layout's tiers: each local tier evicts by the hints' classes (TierRetention
over the layout's HintTable), a hint set on a chain is bounded by the tenant's quota in each tier
its blocks are in, and the periodic sweep forgets the expired ones. Offload (offload.py) demotes a
retained block leaving T0 or T1 whatever the edge's policy (`is_retained`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvtierd.daemon_key import DaemonKey, TenantTag, tenant_tag_of
from kvtierd.retention.hint import RetentionHint
from kvtierd.retention.hint_rooms import keys_with_room
from kvtierd.retention.tier_retention import TierRetention
from kvtierd.tier import Tier
from kvtierd.tiering.layout_tiers import Tiers


@dataclasses.dataclass(frozen=True, slots=True)
class RetainOutcome:
    num_retained_blocks: int  # blocks the hint covers now
    num_downgraded_blocks: int  # over the tenant's quota of a tier they are in: left without the hint
    downgrade_reason: str = ""  # which tier and quota ("" when none was downgraded)


class LayoutRetention:
    """The retention of one layout's blocks across T0, T1 and T2. Thread-safe (the table and the
    tiers take their own locks); `retain` and `release` call the tiers' reclassify through the
    table's listeners, which only move entries between in-memory lists."""

    def __init__(self, tiers: Tiers) -> None:
        self.tiers = tiers
        self.table = table = tiers.hints
        share = tiers.config.retention.max_tenant_share
        index, host, ssd = tiers.index, tiers.host, tiers.ssd
        self.by_tier: dict[Tier, TierRetention] = {}
        self.by_tier[Tier.T0] = TierRetention(Tier.T0, table, lambda: int(share * index.num_blocks))
        index.set_retention(self.by_tier[Tier.T0])
        table.add_listener(index.reclassify)
        if host is not None:
            self.by_tier[Tier.T1] = TierRetention(Tier.T1, table, lambda: int(share * host.index.num_slots))
            host.index.set_retention(self.by_tier[Tier.T1])
            table.add_listener(host.index.reclassify)
        if ssd is not None:
            self.by_tier[Tier.T2] = TierRetention(Tier.T2, table, lambda: int(share * ssd.num_slots))
            ssd.set_retention(self.by_tier[Tier.T2])
            table.add_listener(ssd.reclassify)
        self.num_downgraded_hints = 0  # blocks a hint was set on and not kept, over a quota

    def is_retained(self, key: DaemonKey) -> bool:
        return self.table.is_retained(key)

    def holds(self, tier: Tier, key: DaemonKey) -> bool:
        """Is the block in `tier` (T0 cached, T1 or T2 ready)?"""
        tiers = self.tiers
        if tier is Tier.T0:
            return key in tiers.index.hash_to_block
        if tier is Tier.T1:
            return tiers.host is not None and key in tiers.host.index
        return tiers.ssd is not None and tiers.ssd.holds(key)

    def retain(self, chain: Sequence[DaemonKey], hint: RetentionHint) -> RetainOutcome:
        """Set `hint` on the chain's blocks it covers (positions from the chain's first block; those
        past the chain are not there), in chain order, each while the tenant has room for the hint's
        priority in every tier the block is in (hint_rooms.py; its retained blocks of lower
        priorities give theirs up); a block already retained is renewed without counting again."""
        covered = [chain[i] for i in hint.covered_blocks(self.tiers.layout.block_size) if i < len(chain)]
        if not covered:
            return RetainOutcome(0, 0)
        tag = tenant_tag_of(covered[0])
        rooms = {tier: retention.room_for(tag, hint.priority) for tier, retention in self.by_tier.items()}
        kept, full = keys_with_room(covered, self.is_retained,
                                    lambda key: [tier for tier in self.by_tier if self.holds(tier, key)], rooms)
        self.table.set(kept, hint.session, hint.priority, hint.ttl_s)
        num_downgraded = len(covered) - len(kept)
        self.num_downgraded_hints += num_downgraded
        return RetainOutcome(len(kept), num_downgraded, self._quota_words(full) if full is not None else "")

    def release(self, tag: TenantTag, session: str, chain: Sequence[DaemonKey] | None) -> int:
        """Drop the session's hints on the chain (None: on every block). How many were dropped."""
        return self.table.release(tag, session, chain)

    def sweep(self) -> int:
        """Forget the expired hints (the tiers move their blocks back to class NONE)."""
        return self.table.expire()

    def num_retained_by_tenant(self, tier: Tier) -> dict[TenantTag, int]:
        """Per tenant, its evictable blocks in `tier` held by a live hint (a snapshot)."""
        retention = self.by_tier.get(tier)
        return {} if retention is None else retention.snapshot()

    @property
    def num_downgraded_blocks(self) -> int:
        """Hints not kept over a quota: when set, and when their block entered a tier at quota."""
        return self.num_downgraded_hints + sum(r.num_downgraded_blocks for r in self.by_tier.values())

    def _quota_words(self, tier: Tier) -> str:
        retention = self.by_tier[tier]
        share = self.tiers.config.retention.max_tenant_share
        nbytes = retention.limit_blocks() * self.tiers.layout.bytes_per_block
        return (f"tenant quota of {tier.value.upper()} reached (retention.max_tenant_share {share:.0%} = "
                f"{nbytes / 2**20:.0f} MiB)")
