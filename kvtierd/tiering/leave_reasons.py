"""Why a block left a local tier, as the tiering layer knows it (index/residency.py records it).

A block that leaves T0, T1 or T2 for room (the index names `flushed` itself) is:
- `demoted` when the tier sends it down: an edge out of the tier that copies down (`on_evict`, or
  `write_through`, which copied it before) into a tier below that is there, or a retention hint
  that is live (offload.py demotes retained blocks T0 → T1 and T1 → T2 whatever the edge). What
  the tier below then could not take is counted apart (kvtierd_dropped_offload_blocks_total);
- else `expired` when a retention hint on it lapsed while it was in the tier (the hint would
  have kept it);
- else `evicted`.
Called under the tier index's lock, once per block: a few attribute reads and dict lookups.
"""

from __future__ import annotations

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.residency import Classify, LeaveReason, Residency
from kvtierd.tier import Edge, Tier
from kvtierd.tiering.layout_tiers import Tiers
from kvtierd.tiering.tier_config import EdgePolicy


def residencies(tiers: Tiers) -> dict[Tier, Residency]:
    """The residency recorders of the local tiers present, top down."""
    found = {Tier.T0: tiers.index.residency}
    if tiers.host is not None:
        found[Tier.T1] = tiers.host.index.residency
    if tiers.ssd is not None:
        found[Tier.T2] = tiers.ssd.residency
    return found


def attach_leave_reasons(tiers: Tiers) -> None:
    """Give each local tier's residency recorder its `classify`; call once, before use."""
    for tier, residency in residencies(tiers).items():
        residency.classify = _classifier(tiers, tier)


def _present(tiers: Tiers, tier: Tier) -> bool:
    return {Tier.T0: True, Tier.T1: tiers.host is not None, Tier.T2: tiers.ssd is not None,
            Tier.T3: tiers.remote is not None}[tier]


def _classifier(tiers: Tiers, tier: Tier) -> Classify:
    sends_down = any(_present(tiers, edge.lower) and tiers.config.policy(edge) is not EdgePolicy.OFF
                     for edge in Edge if edge.upper is tier)
    retained_go_down = tier is not Tier.T2 and _present(tiers, Tier(f"t{tier.level + 1}"))
    hints = tiers.hints
    demoted, expired, evicted = LeaveReason.DEMOTED, LeaveReason.EXPIRED, LeaveReason.EVICTED

    def classify(key: DaemonKey, resident_s: float) -> LeaveReason:
        if sends_down or (retained_go_down and hints.is_retained(key)):
            return demoted
        lapsed_at = hints.lapsed_at(key)
        return expired if lapsed_at and lapsed_at > hints.now() - resident_s else evicted

    return classify
