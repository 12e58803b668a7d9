"""`kvtierctl plan` (capacity_plan.py on the command line, no daemon) and `kvtierctl inspect`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from kvtierd.cli.wording import plural
from kvtierd.errors import InvalidArgument
from kvtierd.layout import DTYPES, Layout
from kvtierd.planning.capacity_plan import (
    DEFAULT_BLOCK_SIZES,
    histogram_from_percentiles,
    parse_histogram,
    plan,
    plan_lines,
)
from kvtierd.tier import Tier
from kvtierd.units import parse_bytes

if TYPE_CHECKING:
    from kvtierd.client import KvtierClient

# ----------------------------------------------------------------------------- plan


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("the model's KV shape (one of)")
    shape.add_argument("--bytes-per-token", type=int, help="KV bytes per token, all layers, K and V")
    shape.add_argument("--model-config", help="a transformers config.json (num_hidden_layers, "
                                               "num_key_value_heads, head_dim or hidden_size/num_attention_heads)")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--kv-heads", type=int)
    shape.add_argument("--head-dim", type=int)
    shape.add_argument("--dtype", default="float16", choices=sorted(DTYPES), help="KV dtype (default float16)")
    budgets = parser.add_argument_group("budgets: 40GB is decimal (40e9 bytes), 40GiB binary")
    budgets.add_argument("--t0", required=True, help="device memory for KV (T0)")
    budgets.add_argument("--t1", help="host memory tier (T1)")
    budgets.add_argument("--t2", help="SSD tier (T2)")
    budgets.add_argument("--utilization", type=float, default=1.0, help="usable share of T0 (default 1.0)")
    lengths = parser.add_argument_group("request lengths in tokens (one of)")
    lengths.add_argument("--length", type=int, action="append", help="a request length (repeatable: equal shares)")
    lengths.add_argument("--histogram", help="a file of 'length count' lines")
    lengths.add_argument("--percentiles", help="e.g. 50=200,90=1500,99=6000 (rounded up to the next point)")
    parser.add_argument("--block-sizes", default=",".join(map(str, DEFAULT_BLOCK_SIZES)),
                        help="block sizes to compare (default 8,16,32)")
    parser.add_argument("--json", action="store_true")


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """From --bytes-per-token, or the shape (flags or a config.json) through Layout.bytes_per_token.
    Any decoder's config works here, not only the Llama configs the reference runner loads."""
    if args.bytes_per_token is not None:
        return args.bytes_per_token
    if args.model_config:
        try:
            config = json.loads(Path(args.model_config).read_text())
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"cannot read {args.model_config}: {e}") from None
        if isinstance(config, dict):
            config = config.get("text_config", config)  # multimodal configs nest the language model's
        if not isinstance(config, dict):
            raise InvalidArgument(f"{args.model_config} is not a JSON object (a transformers config.json)")
        try:
            layers = config["num_hidden_layers"]
            heads = config.get("num_key_value_heads") or config["num_attention_heads"]
            head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        except KeyError as e:
            raise InvalidArgument(f"{args.model_config} has no {e.args[0]}") from None
        except (TypeError, ZeroDivisionError) as e:
            raise InvalidArgument(f"{args.model_config}: hidden_size / num_attention_heads: {e}") from None
    elif None in (args.layers, args.kv_heads, args.head_dim):
        raise InvalidArgument("give --bytes-per-token, --model-config, or all of --layers --kv-heads --head-dim")
    else:
        layers, heads, head_dim = args.layers, args.kv_heads, args.head_dim
    return Layout("plan", layers, heads, head_dim, 1, args.dtype).bytes_per_token


def request_lengths(args: argparse.Namespace) -> dict[int, int]:
    given = [x for x in (args.length, args.histogram, args.percentiles) if x]
    if len(given) != 1:
        raise InvalidArgument("give the request lengths once: --length, --histogram or --percentiles")
    if args.length:
        if min(args.length) <= 0:
            raise InvalidArgument("request lengths must be positive")
        return {length: args.length.count(length) for length in set(args.length)}
    if args.histogram:
        try:
            return parse_histogram(Path(args.histogram).read_text())
        except OSError as e:
            raise InvalidArgument(f"cannot read {args.histogram}: {e.strerror}") from None
    points = {}
    for item in args.percentiles.split(","):
        match = re.fullmatch(r"\s*p?(\d+(?:\.\d+)?)\s*=\s*(\d+)\s*", item)
        if match is None:
            raise InvalidArgument(f"--percentiles items look like 50=200, got {item!r}")
        points[int(float(match.group(1)))] = int(match.group(2))
    return histogram_from_percentiles(points)


def run_plan(args: argparse.Namespace) -> int:
    budgets = {tier: parse_bytes(value) for tier, value in ((Tier.T0, args.t0), (Tier.T1, args.t1), (Tier.T2, args.t2))
               if value}
    try:
        block_sizes = [int(b) for b in args.block_sizes.split(",")]
    except ValueError:
        raise InvalidArgument("--block-sizes is a comma-separated list of integers, "
                              f"got {args.block_sizes!r}") from None
    result = plan(kv_bytes_per_token(args), budgets, request_lengths(args), args.utilization, block_sizes)
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=2, default=str))
    else:
        print("\n".join(plan_lines(result)))
    return 0


# ----------------------------------------------------------------------------- inspect


def add_prompt_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-id", required=True, help="the pool (layout) to look in")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", help="token ids, separated by spaces or commas")
    what.add_argument("--tokens-file", help="a file of token ids")
    what.add_argument("--hashes", help="block hashes in hex, comma-separated, chain order")
    parser.add_argument("--cache-salt", help="the prompt's cache_salt (part of block 0's key)")
    parser.add_argument("--lora-id", help="the LoRA adapter id (part of every block's key)")
    parser.add_argument("--json", action="store_true")


def parse_token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in re.split(r"[\s,]+", text.strip()) if t]
    except ValueError:
        raise InvalidArgument("token ids must be integers separated by spaces or commas") from None


def run_inspect(client: KvtierClient, args: argparse.Namespace) -> int:
    """Look the prompt up as the caller's tenant (Lookup: no block is taken or changed)."""
    from kvtierd.block_hash import PromptExtras
    from kvtierd.wire.conversions import pool_layout

    layout = pool_layout(client.stats().pools, args.model_id)
    session = client.attach(layout, map_pool=False)  # closing ends the session
    try:
        token_ids = None
        if args.hashes:
            try:
                hashes = [bytes.fromhex(h.strip()) for h in args.hashes.split(",") if h.strip()]
            except ValueError:
                raise InvalidArgument("--hashes are hex strings separated by commas") from None
        else:
            text = args.tokens if args.tokens is not None else _read(args.tokens_file)
            token_ids = parse_token_ids(text)
            extras = PromptExtras(lora_id=args.lora_id, cache_salt=args.cache_salt)
            hashes = session.namespace.hash_blocks(token_ids, extras)
            token_ids = token_ids[:len(hashes) * session.layout.block_size]
        if not hashes:
            raise InvalidArgument(f"the prompt has no full block (block size {session.layout.block_size})")
        hits = session.lookup(hashes, token_ids).total
    finally:
        session.close()
    block_size = session.layout.block_size
    report = dict(num_blocks=len(hashes), num_hit_blocks=hits.num_blocks, t0=hits.t0, t1=hits.t1, t2=hits.t2,
                  t3=hits.t3, block_size=block_size)
    if args.json:
        print(json.dumps(report))
    elif hits.num_blocks:
        print(f"{hits.num_blocks:,} of {plural(len(hashes), 'full block')} cached "
              f"({hits.num_blocks * block_size:,} of {len(hashes) * block_size:,} tokens): "
              + hit_ranges(*hits))
    else:
        none = ("the prompt's one full block is not cached" if len(hashes) == 1
                else f"none of the prompt's {len(hashes):,} full blocks is cached")
        print(f"{none} (as tenant {session.tenant})")
    return 0


def hit_ranges(*num_tier_blocks: int) -> str:
    """Where a chain's leading hits are, T0 first (Lookup's order): "blocks 0-5 in T0, then block 6 in T1"."""
    ranges, first = [], 0
    for tier, count in zip(Tier, num_tier_blocks):
        if count:
            span = f"block {first}" if count == 1 else f"blocks {first}-{first + count - 1}"
            ranges.append(f"{span} in {tier.upper()}")
            first += count
    return ", then ".join(ranges)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise InvalidArgument(f"cannot read {path}: {e.strerror}") from None
