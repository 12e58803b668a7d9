"""bench_agentic.py's figures per arm, its goals against the `lru` arm, as tables or as JSON."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from benchmarks import _report
from benchmarks._agentic_replay import TurnResult
from kvtierd.planning.agentic_workload import AgenticWorkload
from kvtierd.planning.tier_simulation import SimResult, SimTiers, TierSimulation
from kvtierd.tier import Tier

if TYPE_CHECKING:
    from benchmarks.bench_agentic import ArmResult, Capacities

GOAL_HINT_HIT_TOKENS = 1.3  # hints' kvtierd hit tokens over lru's
GOAL_HINT_RESUMED_TTFT = 1.5  # lru's p50 TTFT of resumed turns over hints'
GOAL_NO_REGRESSION = 0.9  # hints' hit rate of first turns and of sessions without hints, of lru's
TIERS = ("t0", "t1", "t2")

Select = Callable[[TurnResult], bool]
ALL: Select = lambda result: True  # noqa: E731
FIRST: Select = lambda result: result.turn.turn == 0  # noqa: E731
RESUMED: Select = lambda result: result.turn.turn > 0  # noqa: E731
HINTED: Select = lambda result: result.turn.hinted  # noqa: E731
UNHINTED: Select = lambda result: not result.turn.hinted  # noqa: E731


@dataclasses.dataclass(frozen=True)
class ArmFigures:
    """One arm's figures over its completed requests."""

    arm: ArmResult

    def completed(self, select: Select = ALL) -> list[TurnResult]:
        return [result for result in self.arm.results if not result.error and select(result)]

    def hit_rate(self, select: Select) -> float:
        """Hit tokens over prompt tokens of the selected requests (NaN: none)."""
        chosen = self.completed(select)
        prompt_tokens = sum(result.prompt_tokens for result in chosen)
        return sum(result.hit_tokens for result in chosen) / prompt_tokens if prompt_tokens else math.nan

    def ttft_ms(self, select: Select, percentile: float) -> float:
        values = [result.ttft_s * 1e3 for result in self.completed(select) if result.ttft_s is not None]
        return float(np.percentile(values, percentile)) if values else math.nan

    @property
    def kvtierd_hit_tokens(self) -> int:
        return sum(self.arm.tier_hit_tokens.values())

    def as_json(self) -> dict:
        arm = self.arm
        return {"error": arm.error, "wall_s": arm.wall_s, "requests": len(arm.results),
                "completed": len(self.completed()),
                "prompt_tokens": sum(result.prompt_tokens for result in self.completed()),
                "hit_tokens": sum(result.hit_tokens for result in self.completed()),
                "failed_load_tokens": sum(result.failed_load_tokens for result in self.completed()),
                "vllm_hit_tokens": arm.vllm_hit_tokens, "kvtierd_hit_tokens": dict(arm.tier_hit_tokens),
                "max_tenant_share": arm.max_tenant_share, "daemon_tier_blocks": dict(arm.daemon_tier_blocks),
                "daemon_left_blocks": {tier: dict(reasons) for tier, reasons in arm.daemon_left_blocks.items()},
                "connector_counters": dict(arm.connector_counters),
                "hit_rate": {name: self.hit_rate(select) for name, select in
                             (("all", ALL), ("hinted", HINTED), ("unhinted", UNHINTED), ("first", FIRST))},
                "ttft_ms": {f"{name}_p{p}": self.ttft_ms(select, p) for name, select in
                            (("first", FIRST), ("resumed", RESUMED)) for p in (50, 99)},
                "trace": str(arm.trace_path) if arm.trace_path else None}


def simulated(arm: ArmResult, sizes: Capacities) -> SimResult:
    """`kvtierd simulate` of the arm's own requests (their real send times and hints) at the arm's
    capacities and eviction order: what the planning tool predicts for what the arm measured."""
    tiers = SimTiers(sizes.block_size, sizes.num_vllm_blocks, sizes.num_t0_blocks, sizes.num_t1_blocks,
                     sizes.num_t2_blocks, kvtierd=arm.name != "alone",
                     eviction="s3fifo" if arm.name == "freq" else "lru", hints=arm.name == "hints",
                     max_tenant_share=arm.max_tenant_share)
    return TierSimulation(tiers).run([result.trace_request() for result in arm.results if not result.error])


def simulated_json(result: SimResult) -> dict:
    return {"hit_rate": result.all.hit_rate, "vllm_hit_tokens": result.num_engine_hit_tokens,
            "kvtierd_hit_tokens": {tier.name.lower(): n for tier, n in result.tier_hit_tokens.items()}}


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


@dataclasses.dataclass(frozen=True)
class ArmsReport:
    workload: AgenticWorkload
    time_scale: float
    sizes: Capacities
    arms: list[ArmResult]
    wall_s: float  # the whole run, server starts included
    out: Path  # where the traces and capacities.json are

    def figures(self, name: str) -> ArmFigures | None:
        return next((ArmFigures(arm) for arm in self.arms if arm.name == name and not arm.error), None)

    def goals(self) -> list[tuple[str, bool]]:
        """The goals of hints against lru; none when either did not run."""
        lru, hints = self.figures("lru"), self.figures("hints")
        if lru is None or hints is None:
            return []
        hit_tokens = ratio(hints.kvtierd_hit_tokens, lru.kvtierd_hit_tokens)
        all_hits = ratio(sum(r.hit_tokens for r in hints.completed()), sum(r.hit_tokens for r in lru.completed()))
        resumed = ratio(lru.ttft_ms(RESUMED, 50), hints.ttft_ms(RESUMED, 50))
        first = ratio(hints.hit_rate(FIRST), lru.hit_rate(FIRST))
        unhinted = ratio(hints.hit_rate(UNHINTED), lru.hit_rate(UNHINTED))
        return [
            (f"hints: kvtierd's hit tokens >= {GOAL_HINT_HIT_TOKENS}x lru's ({hit_tokens:.2f}x; with vLLM's own "
             f"hits {all_hits:.2f}x)", hit_tokens >= GOAL_HINT_HIT_TOKENS),
            (f"hints: p50 TTFT of resumed turns >= {GOAL_HINT_RESUMED_TTFT}x lower than lru's ({resumed:.2f}x)",
             resumed >= GOAL_HINT_RESUMED_TTFT),
            (f"hints: first turns' hit rate >= {GOAL_NO_REGRESSION}x lru's ({first:.2f}x)",
             first >= GOAL_NO_REGRESSION),
            (f"hints: hit rate of sessions without hints >= {GOAL_NO_REGRESSION}x lru's ({unhinted:.2f}x)",
             unhinted >= GOAL_NO_REGRESSION),
        ]

    def as_json(self) -> dict:
        return {"workload": dataclasses.asdict(self.workload), "time_scale": self.time_scale,
                "capacities": dataclasses.asdict(self.sizes), "wall_s": self.wall_s, "out": str(self.out),
                "arms": {arm.name: ArmFigures(arm).as_json() for arm in self.arms},
                "goals": [{"goal": text, "met": met} for text, met in self.goals()],
                "simulated": {arm.name: simulated_json(simulated(arm, self.sizes)) for arm in self.arms
                              if not arm.error}}

    def print_simulation(self) -> None:
        """Each arm's hit rate and kvtierd hits beside the simulator's on the arm's own trace."""
        rows = []
        for arm in self.arms:
            if arm.error:
                continue
            sim, figures = simulated(arm, self.sizes), ArmFigures(arm)
            real_rate, sim_rate = figures.hit_rate(ALL), sim.all.hit_rate
            rows.append([arm.name, f"{real_rate:.1%}", f"{sim_rate:.1%}", f"{(sim_rate - real_rate) * 100:+.1f}",
                         " / ".join(f"{arm.tier_hit_tokens.get(t, 0):,}" for t in TIERS[:2]) if arm.tier_hit_tokens
                         else "-", f"{sim.tier_hit_tokens[Tier.T0]:,} / {sim.tier_hit_tokens[Tier.T1]:,}",
                         f"{sim.num_engine_hit_tokens:,} ({arm.vllm_hit_tokens:,})"])
        if rows:
            print("the tier simulator (kvtierd simulate --trace) on each arm's own requests, at its capacities:")
            _report.print_table(["arm", "hit rate measured", "simulated", "points", "kvtierd T0 / T1 measured",
                                 "simulated", "vLLM hits simulated (measured)"], rows)

    def print(self, quick: bool, model_name: str) -> None:
        workload, sizes = self.workload, self.sizes
        _report.print_header("agentic sessions with tool pauses against vllm serve: alone, kvtierd lru / freq / "
                             "hints", quick, timing_note="timing: our client's perf_counter, TTFT to the first SSE "
                                                         "data chunk; each arm a new server and a new daemon")
        print(f"workload: {workload.num_sessions} sessions x {workload.num_turns} turns, shared prefix "
              f"{workload.shared_prefix_tokens} tokens, {workload.turn_tokens[0]}-{workload.turn_tokens[1]} new "
              f"tokens a turn, pauses log-normal (median {workload.pause_median_s:g} s, p90 {workload.pause_p90_s:g} "
              f"s, cut at {workload.max_pause_s:g} s) x time scale {self.time_scale:g}, arrivals over "
              f"{workload.arrival_spread_s:g} s, {workload.hinted_fraction:.0%} of sessions hinted, seed "
              f"{workload.seed}; model {model_name}; run {self.wall_s:.0f} s in all")
        t0, t1 = sizes.num_t0_blocks, sizes.num_t1_blocks
        held = (t0 + t1) / sizes.peak_live_blocks
        print(f"capacities (blocks of {sizes.block_size} tokens, {sizes.block_nbytes:,} bytes): vLLM "
              f"{sizes.num_vllm_blocks}; daemon T0 {t0}, T1 {t1}, T2 {sizes.num_t2_blocks or 'off'}; the live "
              f"sessions' KV at its peak {sizes.peak_live_blocks} blocks (T0 + T1 hold {held:.0%} of it), every "
              f"session's last history {sizes.num_distinct_blocks}")
        shares = ", ".join(f"{arm.name} {arm.max_tenant_share:g}" for arm in self.arms if arm.name != "alone")
        if shares:
            print(f"retention.max_tenant_share (what one tenant's retained blocks may hold of a tier): {shares}")
        rows = []
        for arm in self.arms:
            if arm.error:
                rows.append([arm.name, f"FAILED: {arm.error}"] + [""] * 8)
                continue
            figures, tiers = ArmFigures(arm), arm.tier_hit_tokens
            done = figures.completed()
            rows.append([arm.name, f"{len(done)}/{len(arm.results)}", f"{sum(r.prompt_tokens for r in done):,}",
                         f"{arm.vllm_hit_tokens:,}",
                         " / ".join(f"{tiers[t]:,}" for t in TIERS) if tiers else "-",
                         f"{sum(r.failed_load_tokens for r in done):,}" if tiers else "-",
                         " / ".join(f"{figures.hit_rate(s):.0%}" for s in (ALL, HINTED, UNHINTED, FIRST)),
                         f"{figures.ttft_ms(FIRST, 50):,.0f} / {figures.ttft_ms(FIRST, 99):,.0f}",
                         f"{figures.ttft_ms(RESUMED, 50):,.0f} / {figures.ttft_ms(RESUMED, 99):,.0f}",
                         f"{arm.wall_s:.0f}"])
        _report.print_table(["arm", "done", "prompt tokens", "hits vLLM", "hits kvtierd T0 / T1 / T2", "failed loads",
                             "hit rate all / hinted / no hint / first", "TTFT first p50 / p99 ms",
                             "TTFT resumed p50 / p99 ms", "replay s"], rows)
        self.print_simulation()
        for arm in self.arms:
            counters = arm.connector_counters
            if counters:
                print(f"{arm.name}: the connector stored {counters.get('vllm:kvtierd_stored_blocks_total', 0):,.0f} "
                      f"blocks; hints: {counters.get('vllm:kvtierd_retained_blocks_total', 0):,.0f} blocks retained, "
                      f"{counters.get('vllm:kvtierd_downgraded_retention_blocks_total', 0):,.0f} kept without the "
                      f"hint (over the tenant's share), "
                      f"{counters.get('vllm:kvtierd_refused_retention_hints_total', 0):,.0f} hints refused")
            if arm.daemon_left_blocks:
                print(f"{arm.name}: blocks that left the daemon's tiers: " + "; ".join(
                    f"{tier} " + ", ".join(f"{num:,} {reason}" for reason, num in sorted(reasons.items()))
                    for tier, reasons in arm.daemon_left_blocks.items() if reasons))
        print(f"capacities: {self.out / 'capacities.json'}")
        for arm in self.arms:
            if arm.trace_path:
                print(f"trace {arm.name}: {arm.trace_path}")
        for arm in self.arms:
            served = sum(r.hit_tokens for r in ArmFigures(arm).completed())
            counted = arm.vllm_hit_tokens + sum(arm.tier_hit_tokens.values())
            if not arm.error and served != counted:
                print(f"note: {arm.name}: the requests' hit tokens add up to {served:,}, vLLM's and the "
                      f"connector's counters to {counted:,}")
        _report.print_goals([*self.goals(), ("every request of every arm completed",
                                             all(not arm.error and len(ArmFigures(arm).completed()) == len(arm.results)
                                                 for arm in self.arms))])
