"""`kvtierd simulate --agentic` / `--trace`: one trace through several arms (the engine alone,
kvtierd under each eviction order, with and without the trace's hints) at equal capacities, and
the table that compares them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvtierd.planning.request_trace import TraceRequest
from kvtierd.planning.tier_simulation import LOWER_TIERS, SimResult, SimTiers, TierSimulation

GROUPS = ("all", "first turns", "resumed turns", "hinted sessions", "unhinted sessions")


@dataclasses.dataclass(frozen=True, slots=True)
class Arm:
    """A way to run the trace: kvtierd or not, its eviction order, whether hints are honoured."""

    name: str
    kvtierd: bool = True
    eviction: str = "lru"
    hints: bool = False


ARMS = {arm.name: arm for arm in (
    Arm("alone", kvtierd=False),
    Arm("lru"),
    Arm("s3fifo", eviction="s3fifo"),
    Arm("hints", hints=True),
    Arm("hints+s3fifo", eviction="s3fifo", hints=True),
)}
BASELINE_ARM = "lru"  # the ratios compare each arm's kvtierd hit tokens with this arm's


def run_arms(requests: Sequence[TraceRequest], capacities: SimTiers, arm_names: Sequence[str]) -> dict[str, SimResult]:
    """Each named arm's result on `requests`, at `capacities` (its kvtierd, eviction and hints replaced)."""
    unknown = [name for name in arm_names if name not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm {unknown[0]!r}: one of {', '.join(ARMS)}")
    results = {}
    for name in arm_names:
        arm = ARMS[name]
        tiers = dataclasses.replace(capacities, kvtierd=arm.kvtierd, eviction=arm.eviction, hints=arm.hints)
        results[name] = TierSimulation(tiers).run(requests)
    return results


def comparison_lines(results: dict[str, SimResult], capacities: SimTiers) -> list[str]:
    """The table `kvtierd simulate` prints: hit rate per group of requests, kvtierd's hit tokens
    per tier, and each arm's kvtierd hit tokens over the baseline arm's."""
    c = capacities
    lines = [f"capacities in blocks of {c.block_size} tokens: engine {c.engine_blocks:,}, T0 {c.t0_blocks:,}, "
             f"T1 {c.t1_blocks:,}, T2 {c.t2_blocks:,}; edges T0->T1 {c.t0_to_t1.value}, T1->T2 {c.t1_to_t2.value}"]
    first = next(iter(results.values()), None)
    if first is None:
        return lines
    unbounded = first.num_unbounded_hit_tokens / first.all.num_prompt_tokens if first.all.num_prompt_tokens else 0.0
    lines.append(f"requests {first.all.num_requests:,}, prompt tokens {first.all.num_prompt_tokens:,}; "
                 f"an unbounded cache would hit {unbounded:.1%}")
    header = f"{'arm':<13}" + "".join(f"{group:>18}" for group in GROUPS) + \
        "".join(f"{tier.name + ' hits':>10}" for tier in LOWER_TIERS) + f"{'vs ' + BASELINE_ARM:>9}"
    lines += ["hit rate (the engine's own hits and kvtierd's) of", header]
    baseline = results.get(BASELINE_ARM)
    for name, result in results.items():
        ratio = (f"{result.num_kvtierd_hit_tokens / baseline.num_kvtierd_hit_tokens:.2f}x"
                 if baseline is not None and baseline.num_kvtierd_hit_tokens else "-")
        lines.append(f"{name:<13}" + "".join(f"{result.groups[group].hit_rate:>18.1%}" for group in GROUPS) +
                     "".join(f"{result.tier_hit_tokens[tier]:>10,}" for tier in LOWER_TIERS) + f"{ratio:>9}")
    return lines


def comparison_json(results: dict[str, SimResult], capacities: SimTiers) -> dict[str, object]:
    return {
        "capacities": {**dataclasses.asdict(capacities), "t0_to_t1": capacities.t0_to_t1.value,
                       "t1_to_t2": capacities.t1_to_t2.value},
        "arms": {name: {
            "groups": {group: dataclasses.asdict(result.groups[group]) | {"hit_rate": result.groups[group].hit_rate}
                       for group in GROUPS},
            "engine_hit_tokens": result.num_engine_hit_tokens,
            "tier_hit_tokens": {tier.name: n for tier, n in result.tier_hit_tokens.items()},
            "unbounded_hit_tokens": result.num_unbounded_hit_tokens,
            "demoted_blocks": result.num_demoted_blocks,
        } for name, result in results.items()},
    }
