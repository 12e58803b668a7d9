"""What `kvtierctl stats` and `kvtierctl health` print, from Stats / TenantStats responses.

`StatsView` turns one Stats response (and, in watch mode, the previous one and the seconds
between them) into plain rows: the node's T1 and T2 budgets, then per pool the hit rate in
tokens, per tier usage, capacity, hits and evictions, the layout's share of the node's budgets,
bytes moved per direction, and the T2 error counters; rates are deltas over the refresh
interval. Pure functions of the responses: no RPCs here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from kvtierd.cli.kvtierctl_eviction import hit_rate_words, residency_lines
from kvtierd.cli.wording import plural
from kvtierd.planning.capacity import format_bytes
from kvtierd.tier import Tier
from kvtierd.v1 import kvtier_pb2 as pb

DIRECTIONS = {"d2h": "T0->T1", "h2d": "T1->T0", "h2h": "T2<->T1"}
EDGE_NAMES: dict[str, str] = {Tier.T1: "T0->T1", Tier.T2: "T1->T2"}  # the edge into each tier whose drops it counts


def _pool_key(pool: pb.PoolStats) -> tuple:
    return (pool.layout.model_id, pool.layout.block_size, pool.layout.dtype, pool.layout.tp_rank)


@dataclasses.dataclass(frozen=True, slots=True)
class StatsView:
    stats: pb.StatsResponse
    previous: pb.StatsResponse | None = None
    interval_s: float = 0.0

    def _previous_pool(self, pool: pb.PoolStats) -> pb.PoolStats | None:
        if self.previous is None:
            return None
        return next((p for p in self.previous.pools if _pool_key(p) == _pool_key(pool)), None)

    def lines(self, address: str) -> list[str]:
        s = self.stats
        lines = [f"kvtierd {s.version} at {address}: {plural(s.num_sessions, 'session')}, "
                 f"{plural(s.num_reclaimed_refs, 'block ref')} reclaimed from dead sessions"]
        if s.remote.enabled:
            lines.append(store_line(s.remote))
        budgets = node_budget_line(s.pools)
        if budgets:
            lines.append(budgets)
        if not s.pools:
            lines.append("no pools yet: a pool is created when the first client attaches a layout")
        for pool in s.pools:
            lines += [""] + self.pool_lines(pool)
        return lines

    def pool_lines(self, pool: pb.PoolStats) -> list[str]:
        layout, before = pool.layout, self._previous_pool(pool)
        rate = hit_rate_words(pool)
        lines = [f"pool {layout.model_id} ({layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
                 f"{layout.head_dim}, {layout.dtype}, block {layout.block_size}): {rate}",
                 f"  {'tier':<4} {'capacity':>11} {'used':>11} {'cached blocks':>13} {'hit blocks':>10} "
                 f"{'evictions':>9}{'  evictions/s' if before else ''}"]
        before_tiers = {t.tier: t for t in before.tiers} if before else {}
        for tier in pool.tiers:
            used = (pool.num_blocks - pool.num_free_blocks) if tier.tier == Tier.T0 else None
            used_text = f"{used:,} blk" if used is not None else format_bytes(tier.used_bytes)
            line = (f"  {tier.tier:<4} {format_bytes(tier.capacity_bytes):>11} {used_text:>11} "
                    f"{tier.num_cached_blocks:>13,} {tier.num_hit_blocks:>10,} {tier.num_evictions:>9,}")
            if before:
                previous = before_tiers.get(tier.tier)
                delta = tier.num_evictions - (previous.num_evictions if previous else 0)
                line += f"  {delta / self.interval_s:>11,.1f}"
            lines.append(line)
        lines += residency_lines(pool)
        shares = [f"{tier.tier.upper()} {'memory' if tier.tier == Tier.T1 else 'files'} "
                  f"{format_bytes(tier.node_held_bytes)} (fair share {format_bytes(tier.node_share_bytes)})"
                  for tier in pool.tiers if tier.node_capacity_bytes]
        if shares:
            lines.append("  this layout's part of the node budgets: " + ", ".join(shares))
        lines += [f"  T1 page-locking: {format_bytes(tier.pinned_bytes)} of {format_bytes(tier.capacity_bytes)} "
                  f"so far (T1 serves that part; the rest as it is pinned)" for tier in pool.tiers if tier.pinning]
        before_moved = {t.direction: t.bytes_moved for t in before.transfers} if before else {}
        moved = []
        for transfer in pool.transfers:
            text = f"{DIRECTIONS.get(transfer.direction, transfer.direction)} {format_bytes(transfer.bytes_moved)}"
            if before:
                delta = transfer.bytes_moved - before_moved.get(transfer.direction, 0)
                text += f" ({format_bytes(delta / self.interval_s)}/s)"
            moved.append(text)
        lines.append("  moved: " + (", ".join(moved) if moved else "nothing yet"))
        lines.append("  " + loads_line(pool))
        if any(tier.tier != Tier.T0 for tier in pool.tiers):
            lines.append("  " + dropped_line(pool))
        unauthentic = f"{plural(pool.num_unauthentic_blocks, 'unauthentic T2 block')} dropped, " \
            if pool.t2_sealed else ""
        lines.append(f"  errors: {plural(pool.num_corrupted_blocks, 'corrupted T2 block')} dropped, {unauthentic}"
                     f"{plural(pool.num_t2_io_errors, 'T2 I/O error')}, "
                     f"{plural(pool.num_failed_load_blocks, 'failed load')}, "
                     f"{plural(pool.num_failed_offload_blocks, 'failed offload')}"
                     + ("" if pool.t2_admitting or not _has_t2(pool) else f"; T2 NOT admitting: {pool.t2_reason}"))
        if pool.HasField("t3"):
            t3 = pool.t3
            lines.append(f"  t3 (shared store, {t3.codec}): {plural(t3.num_hit_blocks, 'hit block')} "
                         f"({format_bytes(t3.read_bytes)} read), {plural(t3.num_miss_blocks, 'miss', 'misses')}, "
                         f"{plural(t3.num_corrupt_blocks, 'refused value')}; {t3.num_written_blocks:,} written "
                         f"({format_bytes(t3.written_bytes)}), {t3.num_dropped_writes:,} dropped, "
                         f"{t3.num_failed_writes:,} failed, backlog {format_bytes(t3.write_backlog_bytes)}")
        return lines


def loads_line(pool: pb.PoolStats) -> str:
    """The cost a lower-tier hit must beat to be loaded, and the hits declined as slower, by tier."""
    source = {"measured": f"measured by the engines, {plural(pool.num_recompute_reports, 'report')}",
              "policy": "policy.recompute_s_per_token"}.get(pool.recompute_source)
    rule = (f"loaded when faster than recomputing at {pool.recompute_s_per_token * 1e3:.3g} ms/token ({source})"
            if source else "every lower-tier hit loaded (no recompute cost measured yet)")
    declined = [(tier.tier, tier.num_declined_blocks) for tier in pool.tiers]
    if pool.HasField("t3"):
        declined.append((Tier.T3, pool.t3.num_declined_blocks))
    counts = ", ".join(f"{tier.upper()} {plural(n, 'block')}" for tier, n in declined if n)
    return f"loads: {rule}; declined as slower: {counts or 'none'}"


def dropped_line(pool: pb.PoolStats) -> str:
    """The blocks the edges into T1 and T2 did not copy down (no room within
    policy.write_through_wait_s, or T2 refused them), by edge."""
    counts = [f"{EDGE_NAMES[tier.tier]} {plural(tier.num_dropped_offload_blocks, 'block')}"
              for tier in pool.tiers if tier.tier in EDGE_NAMES]
    return ("dropped on the way down (no room below within policy.write_through_wait_s, or refused): "
            + ", ".join(counts))


def node_budget_line(pools: Iterable[pb.PoolStats]) -> str:
    """The node's T1 and T2 budgets (shared by every layout) and what the layouts take of them."""
    budgets = {}
    for pool in pools:
        for tier in pool.tiers:
            if tier.node_capacity_bytes:
                budgets[tier.tier] = tier
    names = {Tier.T1: "T1 host", Tier.T2: "T2 SSD"}
    parts = [f"{names.get(name, name)} {format_bytes(tier.node_used_bytes)} of {format_bytes(tier.node_capacity_bytes)}"
             for name, tier in sorted(budgets.items())]
    return "node budgets (all layouts): " + ", ".join(parts) if parts else ""


def store_line(remote: pb.RemoteStoreStats) -> str:
    """The node's shared store (T3) in one line."""
    state = {"closed": "serving", "open": "BREAKER OPEN", "half_open": "probing (half-open)"}.get(
        remote.breaker_state, remote.breaker_state)
    if remote.credentials_refused:
        state = "CREDENTIALS REFUSED"
    elif remote.num_open_nodes:
        state = f"{remote.num_open_nodes} UNREACHABLE, breakers {remote.breaker_state.replace('_', '-')}"
    return (f"shared store (T3): {remote.mode}, {plural(remote.num_nodes, 'node')}, {state}; "
            f"{plural(remote.num_errors, 'failed call')}, breakers opened "
            f"{plural(remote.num_breaker_opens, 'time')}")


def _has_t2(pool: pb.PoolStats) -> bool:
    return any(t.tier == Tier.T2 for t in pool.tiers)


def tenant_lines(usage: list[pb.TenantUsage]) -> list[str]:
    if not usage:
        return ["no blocks or sessions of that tenant"]
    lines = [f"{'tenant':<24} {'pool':<28} {'sessions':>8} {'T0 held':>9} {'T0 cached':>9} {'T1':>9} {'T2':>9}"
             f"  retained T0 / T1 / T2"]
    for row in usage:
        def size(n: int) -> str:
            return format_bytes(n * row.bytes_per_block)
        retained = " / ".join(size(n) for n in (row.num_t0_retained_blocks, row.num_t1_retained_blocks,
                                                row.num_t2_retained_blocks))
        lines.append(f"{row.tenant:<24} {row.model_id:<28} {row.num_sessions:>8} {size(row.num_t0_held_blocks):>9} "
                     f"{size(row.num_t0_cached_blocks):>9} {size(row.num_t1_blocks):>9} {size(row.num_t2_blocks):>9}"
                     f"  {retained}")
    return lines


def store_problem(remote: pb.RemoteStoreStats) -> str:
    """One line on a shared store that does not answer: refused credentials, no endpoint, or nodes."""
    why = f": {remote.last_error}" if remote.last_error else ""
    if remote.credentials_refused:
        return f"shared store (T3){why}: check remote.username and remote.password_file"
    if remote.mode == "unknown":
        return f"shared store (T3) unreachable: no endpoint answered{why}"
    return f"shared store (T3): {remote.num_open_nodes} of {plural(remote.num_nodes, 'node')} unreachable{why}"


def health_problems(stats: pb.StatsResponse) -> tuple[list[str], list[str]]:
    """(problems, notes): problems make `kvtierctl health` exit 1."""
    problems, notes = [], []
    if stats.draining:
        problems.append("draining: new sessions are refused and gRPC Health is NOT_SERVING "
                        "(`kvtierctl drain --resume` admits them again)")
    if stats.ssd.problem:  # the node runs without the T2 its configuration wants
        problems.append(f"T2 (SSD) is off: {stats.ssd.problem}")
    for pool in stats.pools:
        name = pool.layout.model_id
        held = pool.num_blocks - pool.num_free_blocks
        if held and not stats.num_sessions:
            problems.append(f"{name}: {plural(held, 'T0 block')} held with no session open (a leak)")
        if pool.num_corrupted_blocks:
            problems.append(f"{name}: {plural(pool.num_corrupted_blocks, 'corrupted T2 block')} dropped "
                            "(disk or file damage)")
        if pool.num_unauthentic_blocks:
            problems.append(f"{name}: {plural(pool.num_unauthentic_blocks, 'sealed T2 block')} did not open as "
                            "their own and were dropped (moved or altered on disk?)")
        if pool.num_t2_io_errors:
            problems.append(f"{name}: {plural(pool.num_t2_io_errors, 'T2 I/O error')}")
        if _has_t2(pool) and not pool.t2_admitting:
            problems.append(f"{name}: T2 is not admitting blocks: {pool.t2_reason or 'unknown reason'}")
        if any(tier.num_dropped_offload_blocks for tier in pool.tiers):
            notes.append(f"{name}: {dropped_line(pool)}")
        if pool.num_failed_load_blocks or pool.num_failed_offload_blocks:
            notes.append(f"{name}: {plural(pool.num_failed_load_blocks, 'failed load')} (recomputed), "
                         f"{plural(pool.num_failed_offload_blocks, 'failed offload')}")
    remote = stats.remote
    if remote.enabled and (remote.num_open_nodes or remote.mode == "unknown" or remote.breaker_state != "closed"):
        problems.append(store_problem(remote))
    if remote.enabled and remote.num_errors:
        notes.append(f"shared store (T3): {plural(remote.num_errors, 'failed call')} since start, breakers "
                     f"opened {plural(remote.num_breaker_opens, 'time')}")
    for pool in stats.pools:
        if pool.HasField("t3") and pool.t3.num_corrupt_blocks:
            notes.append(f"{pool.layout.model_id}: {plural(pool.t3.num_corrupt_blocks, 'T3 value')} refused by "
                         "their check (overwritten by another writer, or another layout): served as misses")
    if stats.num_reclaimed_refs:
        notes.append(f"reclaimed {plural(stats.num_reclaimed_refs, 'block ref')} from sessions that died or lost "
                     "their lease (runners that crashed: the daemon returned their blocks)")
    return problems, notes
