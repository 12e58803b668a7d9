"""The `kvtierd` command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys

from kvtierd import __version__
from kvtierd.chat_workload import ChatWorkload
from kvtierd.errors import InvalidArgument, KvtierError


def main(argv: list[str] | None = None) -> int:
    # A file-size limit must surface as EFBIG to the SSD tier (which stops admitting), not kill us.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="kvtierd", description="KV-cache tiering daemon for LLM inference.")
    parser.add_argument("--version", action="version", version=f"kvtierd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

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

    demo = commands.add_parser(
        "demo", help="run the reference Llama runner with and without kvtierd and compare, turn by turn",
        description="Starts a daemon (or uses --address), then runs multi-turn conversations and requests "
                    "sharing a long system prompt through the reference paged-attention runner, twice per turn: "
                    "recomputing everything, and restoring cached prefixes from the daemon's T0, T1 and T2. "
                    "Prints time to first token both ways, hit tokens per tier, and the tier stats.")
    add_demo_flags(demo)

    serve = commands.add_parser(
        "serve", help="run the daemon: gRPC on a unix socket (and TCP), metrics on their own port",
        description="Serves the KvTier gRPC API on a unix socket (mode 0600) by default, with health "
                    "checks, reflection and Prometheus metrics. Configuration: defaults, then the TOML "
                    "file, then KVTIERD_* variables, then flags. SIGTERM stops it cleanly.")
    from kvtierd.daemon_config import add_flags
    add_flags(serve)

    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return run_serve(args)
        if args.command == "demo":
            return run_demo(args)
        return run_simulate(args)
    except KvtierError as e:
        print(f"kvtierd: error: {e}", file=sys.stderr)
        return 2


def run_simulate(args: argparse.Namespace) -> int:
    from kvtierd.simulate import ChatSimulator, report_lines

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


def add_demo_flags(parser: argparse.ArgumentParser) -> None:
    from kvtierd.connectors.demo import DemoOptions

    options, workload = DemoOptions(), DemoOptions().workload
    parser.add_argument("--address", help="use this running daemon (e.g. unix:///run/kvtierd.sock) instead of "
                                          "starting one")
    parser.add_argument("--conversations", type=positive, default=workload.num_conversations)
    parser.add_argument("--turns", type=positive, default=workload.num_turns)
    parser.add_argument("--shared-requests", type=positive, default=workload.num_shared_requests,
                        help="questions after the shared system prompt, per shared phase")
    parser.add_argument("--system-prompt-tokens", type=positive, default=workload.system_prompt_tokens)
    parser.add_argument("--first-turn-tokens", type=positive, default=workload.first_turn_tokens)
    parser.add_argument("--reply-tokens", type=positive, default=workload.reply_tokens)
    parser.add_argument("--layers", type=positive, default=options.model.num_hidden_layers,
                        help="layers of the random-weight model")
    parser.add_argument("--hidden", type=positive, default=options.model.hidden_size,
                        help="hidden size of the random-weight model (heads of 64)")
    parser.add_argument("--config", help="a transformers Llama config.json instead of the random-weight shape")
    parser.add_argument("--weights", help="safetensors file or checkpoint directory for --config")
    parser.add_argument("--t0-blocks", type=positive, default=options.t0_blocks,
                        help="T0 blocks of the daemon the demo starts")
    parser.add_argument("--t1-blocks", type=positive, default=options.t1_blocks,
                        help="T1 blocks of the daemon the demo starts")
    parser.add_argument("--seed", type=int, default=options.seed)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run_demo(args: argparse.Namespace) -> int:
    from kvtierd.connectors.demo import DEMO_MODEL, TURN_HEADER, DemoOptions, run_demo as run, summary_lines, \
        turn_line
    from kvtierd.connectors.demo_workload import DemoWorkload
    from kvtierd.connectors.llama_config import LlamaConfig

    if args.weights and not args.config:
        raise InvalidArgument("--weights needs --config (the checkpoint's config.json)")
    if args.config:
        model = LlamaConfig.from_file(args.config)
    else:
        heads = max(1, args.hidden // 64)
        model = dataclasses.replace(DEMO_MODEL, num_hidden_layers=args.layers, hidden_size=args.hidden,
                                    intermediate_size=args.hidden * 11 // 4, num_attention_heads=heads,
                                    num_key_value_heads=max(1, heads // 2), head_dim=0)
    workload = DemoWorkload(num_conversations=args.conversations, num_turns=args.turns,
                            num_shared_requests=args.shared_requests, system_prompt_tokens=args.system_prompt_tokens,
                            first_turn_tokens=args.first_turn_tokens, reply_tokens=args.reply_tokens,
                            vocab_size=model.vocab_size, seed=args.seed)
    options = DemoOptions(workload=workload, model=model, weights_path=args.weights, seed=args.seed,
                          address=args.address, t0_blocks=args.t0_blocks, t1_blocks=args.t1_blocks)
    if not args.json:
        print(f"kvtierd demo: {'daemon at ' + args.address if args.address else 'starting a daemon'}; "
              f"every turn runs without kvtierd (full recompute), then with it", flush=True)
        print(TURN_HEADER, flush=True)
    report = run(options, progress=None if args.json else lambda turn: print(turn_line(turn), flush=True))
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(f"model: {report.model}")
        print("\n".join(summary_lines(report)))
    return 0 if report.all_same and report.num_leaked_blocks == 0 else 1


def run_serve(args: argparse.Namespace) -> int:
    from kvtierd.daemon_config import load_config, overrides_from_args
    from kvtierd.server import run

    return run(load_config(args.config, overrides=overrides_from_args(args)))


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


if __name__ == "__main__":
    sys.exit(main())
