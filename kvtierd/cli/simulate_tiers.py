"""`kvtierd simulate --agentic` and `kvtierd simulate --trace FILE`: a trace through the engine's
prefix cache and kvtierd's tiers under several arms (policy_comparison.py), in seconds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvtierd.arg_types import positive
from kvtierd.errors import InvalidArgument
from kvtierd.index.eviction_order import EVICTION_ORDERS
from kvtierd.planning.agentic_trace import planned_trace
from kvtierd.planning.agentic_workload import AgenticSessions, AgenticWorkload
from kvtierd.planning.policy_comparison import ARMS, comparison_json, comparison_lines, run_arms
from kvtierd.planning.request_trace import read_trace
from kvtierd.planning.tier_simulation import SimTiers
from kvtierd.tiering.tier_config import EDGE_POLICIES, EdgePolicy


def add_tier_flags(simulate: argparse.ArgumentParser) -> None:
    tiers = simulate.add_argument_group(
        "agentic sessions through the tiers",
        "--agentic or --trace compares the engine alone with kvtierd's eviction orders and hints at equal "
        "capacities (no engine, no bytes): hit rates of first and resumed turns, of hinted and unhinted sessions")
    source = tiers.add_mutually_exclusive_group()
    source.add_argument("--agentic", action="store_true",
                        help="sessions sharing a 1,024-token prefix, histories growing 100-300 tokens a turn, "
                             "log-normal tool pauses (median 5 s, p90 60 s), 3 in 4 sessions sending hints")
    source.add_argument("--trace", metavar="FILE", type=argparse.FileType("r"),
                        help="replay a recorded trace (JSON lines, e.g. written by benchmarks/bench_agentic.py)")
    defaults = AgenticWorkload()
    tiers.add_argument("--sessions", type=positive, default=defaults.num_sessions)
    tiers.add_argument("--session-turns", type=positive, default=defaults.num_turns, help="turns per session")
    tiers.add_argument("--block-size", type=positive, default=16, help="tokens per block (default 16)")
    tiers.add_argument("--engine-blocks", type=int, default=256, help="the engine's own prefix cache (default 256)")
    tiers.add_argument("--t0-blocks", type=positive, default=256)
    tiers.add_argument("--t1-blocks", type=int, default=512)
    tiers.add_argument("--t2-blocks", type=int, default=0)
    tiers.add_argument("--t0-to-t1", choices=EDGE_POLICIES, default=EdgePolicy.ON_EVICT.value)
    tiers.add_argument("--t1-to-t2", choices=EDGE_POLICIES, default=EdgePolicy.WRITE_THROUGH.value)
    tiers.add_argument("--max-tenant-share", type=float, default=0.5,
                       help="[retention] max_tenant_share: of each tier, what one tenant's retained blocks may hold")
    tiers.add_argument("--arms", default=",".join(ARMS),
                       help=f"comma-separated, of {', '.join(ARMS)} (eviction orders: {', '.join(EVICTION_ORDERS)})")


def run_tier_simulation(args: argparse.Namespace) -> int:
    try:
        capacities = SimTiers(args.block_size, args.engine_blocks, args.t0_blocks, args.t1_blocks, args.t2_blocks,
                              t0_to_t1=EdgePolicy(args.t0_to_t1), t1_to_t2=EdgePolicy(args.t1_to_t2),
                              max_tenant_share=args.max_tenant_share)
        if not 0.0 <= args.max_tenant_share <= 1.0:
            raise ValueError(f"--max-tenant-share {args.max_tenant_share} is not in [0, 1]")
        if args.trace is not None:
            args.trace.close()
            requests = read_trace(Path(args.trace.name))
        else:
            workload = AgenticWorkload(num_sessions=args.sessions, num_turns=args.session_turns, seed=args.seed)
            requests = planned_trace(AgenticSessions(workload))
        results = run_arms(requests, capacities, [name.strip() for name in args.arms.split(",") if name.strip()])
    except ValueError as error:
        raise InvalidArgument(str(error)) from None
    if args.json:
        print(json.dumps(comparison_json(results, capacities), indent=2))
    else:
        print("\n".join(comparison_lines(results, capacities)))
    return 0
