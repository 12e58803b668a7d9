"""`kvtierctl`: the operator's CLI. How full is the node, how effective is the cache, how much can it take.

    kvtierctl stats [--tenant NAME|'*'] [--watch [SECONDS]] [--json]
    kvtierctl plan --bytes-per-token N | --layers L --kv-heads H --head-dim D [--dtype T] | --model-config config.json
                   --t0 40GB [--t1 SIZE] [--t2 SIZE] (--length N | --histogram FILE | --percentiles 50=200,90=1500)
    kvtierctl inspect --model-id M (--tokens "1 2 3" | --tokens-file F | --hashes HEX,...) [--cache-salt S]
    kvtierctl evict [--tenant NAME | --all] [--tier t0|t1|t2 ...] [--model-id M]
    kvtierctl flush [--tenant NAME | --all] [--model-id M]
    kvtierctl forget --tenant NAME
    kvtierctl drain [--resume] [--wait SECONDS]
    kvtierctl health
    kvtierctl --version

Exit codes: 0 done (health: healthy), or stdout's reader went away (a closed pipe: `| head -1`);
1 health found problems, or drain --wait timed out; 2 a bad argument; 3 the daemon is unreachable,
or did not answer within --timeout seconds; 4 the daemon refused (credentials, permission);
130 interrupted (Ctrl-C, except ending --watch). Every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import time
from typing import TYPE_CHECKING, NoReturn

from google.protobuf.json_format import MessageToDict

from kvtierd import __version__
from kvtierd.cli.unix_tool import SubcommandParser, quiet_on_closed_pipe, wait_unless_reader_gone
from kvtierd.cli.wording import plural
from kvtierd.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KvtierError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvtierd.tier import LOCAL_TIERS, Tier

if TYPE_CHECKING:  # imported where used: `kvtierctl plan` runs without grpc's client or torch
    from kvtierd.cli.kvtierctl_report import StatsView
    from kvtierd.client import KvtierClient
    from kvtierd.v1 import kvtier_pb2 as pb

EXIT_PROBLEMS, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_REFUSED, EXIT_INTERRUPTED = 1, 2, 3, 4, 130


class OneLineParser(SubcommandParser):
    """A usage error is one line on stderr and exit 2, not argparse's usage block (`--help` still
    prints everything). The parser of every subcommand is one too (add_subparsers' parser_class),
    and refuses its own unknown arguments: the line points at that subcommand's --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"kvtierctl: error: {message} (see `{self.prog} --help`)\n")


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"needs a finite number of seconds > 0, got {text!r}")
    return value


@quiet_on_closed_pipe  # `kvtierctl stats | head -1`: exit 0, no traceback
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="kvtierctl", description="Operate a kvtierd daemon: stats, capacity "
                           "planning, inspect, evict, flush, drain, health.",
                           epilog="exit codes: 0 ok, 1 problems found, 2 bad argument, 3 daemon unreachable "
                           "(or no answer within --timeout), 4 refused, 130 interrupted; a closed pipe "
                           "(kvtierctl stats | head -1) ends quietly with 0")
    parser.add_argument("--version", action="version", version=f"kvtierctl {__version__}")
    parser.add_argument("--address", help="the daemon (default: KVTIERD_ADDRESS, else the default socket)")
    parser.add_argument("--token", help="bearer token (default: KVTIERD_TOKEN)")
    parser.add_argument("--timeout", type=seconds, default=10.0,
                        help="seconds to wait for each answer of the daemon, else it is unreachable (exit 3; "
                        "default 10). evict and flush, once the daemon answers, wait up to 120 s")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    stats = commands.add_parser("stats", help="usage, hit rate, evictions, bytes moved, errors per tier")
    stats.add_argument("--tenant", help="per-tenant usage: a tenant's name, or '*' for every tenant (admin)")
    stats.add_argument("--watch", nargs="?", const=2.0, type=seconds, metavar="SECONDS",
                       help="refresh every SECONDS (default 2) with rates, until Ctrl-C or the end of "
                            "the pipe it writes to")
    stats.add_argument("--json", action="store_true", help="print the raw figures as JSON")

    from kvtierd.cli.kvtierctl_plan import add_plan_flags, add_prompt_flags
    add_plan_flags(commands.add_parser("plan", help="capacity planning for a model and a length mix (no daemon)"))
    add_prompt_flags(commands.add_parser("inspect", help="which tiers hold a prompt's prefix"))

    for name, text in (("evict", "drop cached blocks nobody holds from tiers (T0: they move down under "
                                 "on_evict)"), ("flush", "drop cached blocks nobody holds from every tier")):
        command = commands.add_parser(name, help=text)
        whose = command.add_mutually_exclusive_group()
        whose.add_argument("--tenant", default="", help="whose blocks (default: the caller's; another: admin)")
        whose.add_argument("--all", action="store_true", help="every tenant's blocks (admin)")
        if name == "evict":
            command.add_argument("--tier", action="append", choices=LOCAL_TIERS, default=[],
                                 help="a tier (repeatable; default t0)")
        command.add_argument("--model-id", help="only the pool of this model id")
        command.add_argument("--json", action="store_true")

    forget = commands.add_parser("forget", help="admin: destroy a tenant's data key (its sealed T2 blocks become "
                                                "unreadable) and drop its blocks from every tier")
    forget.add_argument("--tenant", required=True, help="the tenant to forget, by name")
    forget.add_argument("--json", action="store_true")

    drain = commands.add_parser("drain", help="stop admitting sessions (health NOT_SERVING) before maintenance")
    drain.add_argument("--resume", action="store_true", help="admit sessions again")
    drain.add_argument("--wait", type=float, metavar="SECONDS", help="wait until no session is attached")
    commands.add_parser("health", help="serving status, leaked blocks, T2 errors; exit 1 on a problem")

    args = parser.parse_args(argv)
    # Ctrl-C stops kvtierctl even when started with SIGINT ignored (a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.command == "plan":
            from kvtierd.cli.kvtierctl_plan import run_plan
            return run_plan(args)
        return run_against_daemon(args)
    except KeyboardInterrupt:  # --watch ends on Ctrl-C by itself, with 0
        print("kvtierctl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (Unauthenticated, PermissionDenied) as e:
        print(f"kvtierctl: refused: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except Unavailable as e:
        print(f"kvtierctl: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KvtierError as e:
        print(f"kvtierctl: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, InvalidArgument) else EXIT_PROBLEMS


def run_against_daemon(args: argparse.Namespace) -> int:
    from kvtierd.cli.kvtierctl_report import StatsView, health_problems, tenant_lines
    from kvtierd.client import KvtierClient
    from kvtierd.client.calls import OPERATION_TIMEOUT_S
    from kvtierd.wire.conversions import pool_layout

    with (KvtierClient(args.address, token=args.token, timeout_s=args.timeout, max_attempts=1) as client,
          answered_within(client.target, args.timeout)):
        if args.command == "stats":
            if args.tenant is not None:
                usage = client.tenant_stats(args.tenant)
                print(json.dumps([MessageToDict(u, preserving_proto_field_name=True) for u in usage], indent=2)
                      if args.json else "\n".join(tenant_lines(usage)))
                return 0
            if args.watch is None:
                stats = client.stats()
                print(json.dumps(MessageToDict(stats, preserving_proto_field_name=True), indent=2) if args.json
                      else "\n".join(StatsView(stats).lines(client.target)))
                return 0
            return watch(client, args.watch, StatsView)
        if args.command == "inspect":
            from kvtierd.cli.kvtierctl_plan import run_inspect
            return run_inspect(client, args)
        if args.command in ("evict", "flush"):
            # Stats first: a daemon that does not answer is found within --timeout, not Evict's deadline.
            pools = client.stats().pools
            layout = pool_layout(pools, args.model_id) if args.model_id else None
            tiers = getattr(args, "tier", None) or ([Tier.T0] if args.command == "evict" else [])
            with answered_within(client.target, OPERATION_TIMEOUT_S):
                result = client.evict(args.tenant, all_tenants=args.all, tiers=tiers, layout=layout)
            print_dropped(result, args.json)
            return 0
        if args.command == "forget":
            client.stats()  # a daemon that does not answer is found within --timeout
            with answered_within(client.target, OPERATION_TIMEOUT_S):
                forgotten = client.forget(args.tenant)
            if not args.json:
                print(f"tenant {args.tenant!r}: data key {'destroyed' if forgotten.key_destroyed else 'absent'}; ",
                      end="")
            print_dropped(forgotten, args.json)
            if not forgotten.settled and not args.json:
                print("note: copies were still in flight after 10 s; one of the tenant's may have landed after "
                      "the forget: run it again", file=sys.stderr)
            return 0
        if args.command == "drain":
            result = client.drain(resume=args.resume)
            state = "draining: new sessions are refused" if result.draining else "admitting sessions"
            print(f"{state}; {plural(result.num_sessions, 'session')} attached", flush=True)
            if args.wait is not None and result.draining:
                return wait_for_sessions(client, args.wait)
            return 0
        stats = client.stats()
        problems, notes = health_problems(stats)
        for line in problems:
            print(f"PROBLEM: {line}")
        for line in notes:
            print(f"note: {line}")
        if not problems:
            print(f"healthy: {client.target} answers; no leaked blocks; "
                  + ("no T2 errors" if stats.ssd.enabled else "T2 off (ssd.directory '' or ssd.capacity_bytes 0)")
                  + ("; the shared store (T3) answers" if stats.remote.enabled else ""))
        return EXIT_PROBLEMS if problems else 0


def print_dropped(result: pb.EvictResponse | pb.ForgetResponse, as_json: bool) -> None:
    """What an evict, flush or forget dropped: a line, or the response as JSON."""
    from kvtierd.v1 import kvtier_pb2

    if as_json:
        print(json.dumps(MessageToDict(result, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True)))
        return
    dropped = result.dropped if isinstance(result, kvtier_pb2.ForgetResponse) else result
    print(f"dropped {dropped.num_t0_blocks:,} T0, {dropped.num_t1_blocks:,} T1, {dropped.num_t2_blocks:,} T2 "
          f"blocks; {plural(dropped.num_t0_held_blocks, 'T0 block')} skipped (in use)")


@contextlib.contextmanager
def answered_within(target: str, timeout_s: float):
    """A call that runs out of time is a daemon that does not answer (it accepts connections but
    never replies, or hangs): Unavailable, exit 3, naming the address."""
    try:
        yield
    except DeadlineExceeded:
        raise Unavailable(f"kvtierd at {target} did not answer within {timeout_s:g} s: is the daemon running, "
                          "and serving at this address?") from None


def watch(client: KvtierClient, interval_s: float, view: type[StatsView]) -> int:
    """Refresh until Ctrl-C, or until stdout's reader goes away (exit 0 both), found at once, not at
    the next refresh; on a terminal the screen is redrawn in place."""
    previous, before_s = None, time.monotonic()
    try:
        while True:
            stats, now_s = client.stats(), time.monotonic()
            text = "\n".join(view(stats, previous, now_s - before_s).lines(client.target))
            sys.stdout.write(("\x1b[H\x1b[2J" if sys.stdout.isatty() else "") + text + "\n\n")
            sys.stdout.flush()
            previous, before_s = stats, now_s
            if wait_unless_reader_gone(interval_s):
                return 0
    except KeyboardInterrupt:
        return 0


def wait_for_sessions(client: KvtierClient, timeout_s: float) -> int:
    """0 once no session is attached; 1 after `timeout_s`; Ctrl-C is an interruption (130), not success."""
    deadline = time.monotonic() + timeout_s
    while (num_sessions := client.stats().num_sessions) and time.monotonic() < deadline:
        time.sleep(0.5)
    if num_sessions:
        print(f"still {plural(num_sessions, 'session')} attached after {timeout_s:g} s", file=sys.stderr)
        return EXIT_PROBLEMS
    print("no sessions attached: safe to stop the daemon")
    return 0


if __name__ == "__main__":
    sys.exit(main())
