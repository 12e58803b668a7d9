"""The flags of `kvtierd demo` and the command itself: options from flags, progress, the report.

Loaded by kvtierd/cli/kvtierd_main.py only when the command is `demo`, so that `kvtierd serve` and
`kvtierd simulate` import nothing of the connectors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvtierd.arg_types import positive
from kvtierd.connectors.demo.demo import (
    CHAT_T0_BLOCKS,
    CHAT_T1_BLOCKS,
    CHAT_WORKLOAD,
    RANDOM_MODEL,
    RANDOM_T0_BLOCKS,
    RANDOM_T1_BLOCKS,
    DemoOptions,
    summary_lines,
    turn_line,
)
from kvtierd.connectors.demo.demo import run_demo as run
from kvtierd.connectors.demo.demo_workload import DemoWorkload
from kvtierd.errors import InvalidArgument


def add_demo_flags(parser: argparse.ArgumentParser) -> None:
    chat, random_traffic = CHAT_WORKLOAD, DemoWorkload()
    parser.add_argument("--address", help="use this running daemon (e.g. unix:///run/kvtierd.sock) instead of "
                                          "starting one")
    model = parser.add_argument_group("model")
    model.add_argument("--model", metavar="PATH", help="a Llama GGUF file or Hugging Face directory (config.json, "
                                                       "*.safetensors, tokenizer) instead of SmolLM2-135M-Instruct")
    model.add_argument("--model-cache", metavar="DIR",
                       help="where SmolLM2 is fetched to (default "
                            "$XDG_CACHE_HOME/kvtierd/models or ~/.cache/kvtierd/models)")
    model.add_argument("--random-weights", action="store_true",
                       help="a small random-weight Llama instead, with messages of random token ids (fast; no fetch)")
    # The flags of the random-weight model default to None: given without --random-weights, they are refused.
    model.add_argument("--layers", type=positive,
                       help=f"layers of the random-weight model (default {RANDOM_MODEL.num_hidden_layers})")
    model.add_argument("--hidden", type=positive,
                       help=f"hidden size of the random-weight model, heads of 64 (default {RANDOM_MODEL.hidden_size})")
    traffic = parser.add_argument_group("traffic")
    traffic.add_argument("--conversations", type=positive,
                         help=f"default {chat.num_conversations} ({random_traffic.num_conversations} random)")
    traffic.add_argument("--turns", type=positive, help=f"default {chat.num_turns} ({random_traffic.num_turns} random)")
    traffic.add_argument("--shared-requests", type=positive,
                         help=f"questions after the shared system prompt, per shared phase; default "
                              f"{chat.num_shared_requests} ({random_traffic.num_shared_requests} random)")
    traffic.add_argument("--reply-tokens", type=positive,
                         help=f"at most, per reply; default {chat.reply_tokens} ({random_traffic.reply_tokens} random)")
    traffic.add_argument("--system-prompt-tokens", type=positive,
                         help=f"random weights: the system prompt's length (default "
                              f"{random_traffic.system_prompt_tokens})")
    traffic.add_argument("--first-turn-tokens", type=positive,
                         help=f"random weights: a conversation's first message (default "
                              f"{random_traffic.first_turn_tokens})")
    tiers = parser.add_argument_group("tiers of the daemon the demo starts")
    tiers.add_argument("--t0-blocks", type=positive,
                       help=f"default {CHAT_T0_BLOCKS} ({RANDOM_T0_BLOCKS} random)")
    tiers.add_argument("--t1-blocks", type=positive,
                       help=f"default {CHAT_T1_BLOCKS} ({RANDOM_T1_BLOCKS} random)")
    parser.add_argument("--seed", type=int, help="random weights: of the weights and tokens (default 0)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (progress goes to stderr)")


# The flags that shape the random-weight model and its random-token messages: None unless given.
RANDOM_ONLY_FLAGS = ("layers", "hidden", "system_prompt_tokens", "first_turn_tokens", "seed")


def refuse_flags_that_do_not_apply(args: argparse.Namespace) -> None:
    """A flag the chosen model ignores is an error, not a silent full run of another model."""
    if args.model and args.random_weights:
        raise InvalidArgument("--model and --random-weights exclude each other")
    if not args.random_weights:
        given = [f"--{name.replace('_', '-')}" for name in RANDOM_ONLY_FLAGS if getattr(args, name) is not None]
        if given:
            raise InvalidArgument(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with "
                                  "--random-weights")
    if args.model_cache and (args.model or args.random_weights):
        raise InvalidArgument(f"--model-cache applies only to SmolLM2 (not with "
                              f"{'--model' if args.model else '--random-weights'})")


def demo_options(args: argparse.Namespace) -> DemoOptions:
    """DemoOptions from the demo's flags: unset counts take the chosen model's defaults."""
    refuse_flags_that_do_not_apply(args)
    base = DemoOptions()
    seed = 0 if args.seed is None else args.seed
    if args.random_weights:
        layers, hidden = args.layers or RANDOM_MODEL.num_hidden_layers, args.hidden or RANDOM_MODEL.hidden_size
        heads = max(1, hidden // 64)
        random_model = dataclasses.replace(RANDOM_MODEL, num_hidden_layers=layers, hidden_size=hidden,
                                           intermediate_size=hidden * 11 // 4, num_attention_heads=heads,
                                           num_key_value_heads=max(1, heads // 2), head_dim=0)
        random_traffic = DemoWorkload()
        workload = DemoWorkload(system_prompt_tokens=args.system_prompt_tokens or random_traffic.system_prompt_tokens,
                                first_turn_tokens=args.first_turn_tokens or random_traffic.first_turn_tokens,
                                vocab_size=random_model.vocab_size, seed=seed)
        base = dataclasses.replace(base, random_weights=True, random_model=random_model, t0_blocks=RANDOM_T0_BLOCKS,
                                   t1_blocks=RANDOM_T1_BLOCKS)
    else:
        workload = CHAT_WORKLOAD
    counts = {"num_conversations": args.conversations, "num_turns": args.turns,
              "num_shared_requests": args.shared_requests, "reply_tokens": args.reply_tokens}
    workload = dataclasses.replace(workload, **{k: v for k, v in counts.items() if v is not None})
    tiers = {"t0_blocks": args.t0_blocks, "t1_blocks": args.t1_blocks}
    return dataclasses.replace(base, workload=workload, model_path=args.model, model_cache=args.model_cache,
                               seed=seed, address=args.address,
                               **{k: v for k, v in tiers.items() if v is not None})


def run_demo(args: argparse.Namespace) -> int:
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
