"""The vLLM connector's store path: RPCs, request bytes and daemon CPU per stored block, beside the
whole-chain store a plain client makes of the same steps.

Ours: the real KvtierdConnector (both roles) in this process, driven step by step as vLLM's engine
core drives it (tests/connectors/vllm/vllm_fakes.Engine: vLLM's scheduler output objects, a CPU KV
cache, a forward that writes each computed block), against a real `kvtierd serve`. Requests run
four at a time, in lockstep: chunked prefill of a 1,100-token prompt (blocks of 32 tokens, 256-token
chunks: 34 full blocks), then decode (a block fills every 32 tokens). Each step, the connector
stores the blocks it completed: Acquire of the parent and the new blocks, a copy into the pool,
Commit of the new blocks, Release. Counts from the connector's own metrics (store_rpcs,
store_request_bytes: the hashes and u32 token ids those calls carry, stored_blocks), the daemon's
CPU from /proc.

Baseline, the whole-chain store (what the connector sent before its store path was incremental):
a plain KvtierClient session on a second daemon, the same requests and the same step boundaries,
each step Acquiring the request's whole chain from block 0 (for_store), Committing the blocks the
daemon did not hold, Releasing. No page copy on this side: it is the client's, not the daemon's,
and the same bytes either way.

Three phases per side: prefill (the chunked prompts), decode (the blocks the answers fill), and
repeat (the same prompts again, new requests vLLM serves from its own prefix cache: every full
block of the prompt is there). Goals: a block decode fills costs what the block and its parent are, not
the chain: the Acquire carries the parent's and the block's hash and tokens, the Commit the block's,
3 x (32 + 4 x 32) = 480 bytes; and no store RPC in the repeat phase. The ratios to the whole chain
follow from the prompt's length (a 35-block chain for one block in decode, 8-block chunks in prefill).

Run: python benchmarks/bench_store_path.py [--quick]
"""

from __future__ import annotations

import dataclasses
import math
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from benchmarks.bench_vllm_serve import process_cpu_s  # noqa: E402
from kvtierd.client import KvtierClient  # noqa: E402
from kvtierd.launch.daemon_process import ONE_LAYOUT, DaemonProcess, small_daemon_args, wait_until  # noqa: E402
from kvtierd.layout import Layout  # noqa: E402
from tests.connectors.vllm.vllm_fakes import (  # noqa: E402
    Engine,
    KVCacheBlocks,
    Request,
    SchedulerOutput,
    new_request_data,
    prompt,
    running_request_data,
)

BLOCK_SIZE = 32
PROMPT_TOKENS = 1_100
CHUNK_TOKENS = 256
CONCURRENCY = 4
HASH_BYTES = 32  # sha256
DECODE_BLOCK_BYTES = 3 * (HASH_BYTES + 4 * BLOCK_SIZE)  # Acquire (parent and block), Commit (block)
PHASES = ("prefill", "decode", "repeat")


@dataclasses.dataclass(frozen=True)
class Workload:
    num_waves: int  # CONCURRENCY requests each
    decode_tokens: int


FULL = Workload(num_waves=8, decode_tokens=128)
QUICK = Workload(num_waves=2, decode_tokens=64)


def decoded_token(request: Request) -> int:
    return (len(request.all_token_ids) * 17 + int.from_bytes(request.request_id.encode()[-2:], "little")) % 30_000


@dataclasses.dataclass
class Traffic:
    """What a phase's stores sent and cost the daemon."""

    stored_blocks: int = 0
    rpcs: int = 0
    request_bytes: int = 0
    daemon_cpu_s: float = 0.0

    def per_block(self, value: float) -> float:
        return value / self.stored_blocks if self.stored_blocks else math.nan


def steps(num_computed_tokens: int, num_tokens: int) -> Iterator[int]:
    """Tokens scheduled per prefill step: 256-token chunks up to `num_tokens`."""
    while num_computed_tokens < num_tokens:
        chunk = min(CHUNK_TOKENS, num_tokens - num_computed_tokens)
        yield chunk
        num_computed_tokens += chunk


def full_blocks_before_the_last_token(request: Request) -> int:
    """What vLLM's own prefix cache serves of a prompt it computed before: its full blocks, short of the last token."""
    return (request.num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


class ConnectorSide:
    """The connector on `engine`: a wave of requests through vLLM's steps; Traffic from its metrics."""

    def __init__(self, engine: Engine, daemon: DaemonProcess, decode_tokens: int) -> None:
        self.engine = engine
        self.worker = engine.worker._worker()
        self.daemon = daemon
        self.decode_tokens = decode_tokens
        self.block_ids: dict[str, list[int]] = {}

    def admit(self, requests: list[Request], num_cached_tokens: int) -> SchedulerOutput:
        """The first step of `requests`: a lookup each, blocks for prompt and answer, and what vLLM's cache has."""
        new = []
        for request in requests:
            assert self.engine.matched_tokens(request, num_cached_tokens) == 0  # nothing more in kvtierd
            num_blocks = math.ceil((request.num_tokens + self.decode_tokens) / BLOCK_SIZE)
            ids, self.engine.free_block_ids = (self.engine.free_block_ids[:num_blocks],
                                               self.engine.free_block_ids[num_blocks:])
            self.block_ids[request.request_id] = ids
            self.engine.scheduler.update_state_after_alloc(request, KVCacheBlocks(ids), 0)
            new.append(new_request_data(request, ids, num_cached_tokens))
        return new

    def step(self, requests: list[Request], num_scheduled: list[int], new=()) -> None:
        new_ids = {data.req_id for data in new}
        running = [r for r in requests if r.request_id not in new_ids]
        output = SchedulerOutput(list(new), running_request_data(running),
                                 {r.request_id: n for r, n in zip(requests, num_scheduled)}, set())
        computed = [(r, self.block_ids[r.request_id],
                     range(r.num_computed_tokens // BLOCK_SIZE, (r.num_computed_tokens + n) // BLOCK_SIZE))
                    for r, n in zip(requests, num_scheduled)]
        self.engine.compute_step(output, computed)

    def finish(self, requests: list[Request]) -> None:
        for request in requests:
            self.engine.finish(request, self.block_ids.pop(request.request_id))
        self.engine.drain(timeout_s=120)

    def traffic(self, cpu_before_s: float) -> Traffic:
        taken = self.worker.stats.take()  # None: no store RPC since the last
        data = taken.data if taken is not None else {}
        return Traffic(data.get("stored_blocks", 0), data.get("store_rpcs", 0), data.get("store_request_bytes", 0),
                       process_cpu_s(self.daemon.process.pid) - cpu_before_s)


def run_connector(daemon: DaemonProcess, workload: Workload) -> tuple[dict[str, Traffic], Layout]:
    """The waves through the connector; (Traffic per phase, the layout it attached with)."""
    num_engine_blocks = CONCURRENCY * math.ceil((PROMPT_TOKENS + workload.decode_tokens) / BLOCK_SIZE) + 1
    engine = Engine(daemon.address, num_engine_blocks=num_engine_blocks, block_size=BLOCK_SIZE)
    side = ConnectorSide(engine, daemon, workload.decode_tokens)
    totals = {phase: Traffic() for phase in PHASES}
    try:
        side.worker.stats.take()
        for wave in range(workload.num_waves):
            numbers = range(wave * CONCURRENCY, (wave + 1) * CONCURRENCY)
            requests = [Request(f"wave{wave}-{n}", prompt(n, PROMPT_TOKENS), BLOCK_SIZE) for n in numbers]
            cpu_s, stored_before = process_cpu_s(daemon.process.pid), side.worker.stores.num_stored_blocks
            new = side.admit(requests, 0)
            for index, chunk in enumerate(steps(0, PROMPT_TOKENS)):
                side.step(requests, [chunk] * len(requests), new if index == 0 else ())
            for request in requests:
                request.append_output(decoded_token(request))
            expected = stored_before + CONCURRENCY * (PROMPT_TOKENS // BLOCK_SIZE)
            assert wait_until(lambda: side.worker.stores.num_stored_blocks >= expected, timeout_s=120), (
                side.worker.stores.num_stored_blocks, expected, side.worker.stores.num_dropped_stores)
            add(totals["prefill"], side.traffic(cpu_s))

            cpu_s = process_cpu_s(daemon.process.pid)
            for _ in range(workload.decode_tokens):
                side.step(requests, [1] * len(requests))
                for request in requests:
                    request.append_output(decoded_token(request))
            side.finish(requests)
            add(totals["decode"], side.traffic(cpu_s))

            cpu_s = process_cpu_s(daemon.process.pid)
            again = [Request(f"again{wave}-{n}", prompt(n, PROMPT_TOKENS), BLOCK_SIZE) for n in numbers]
            cached = full_blocks_before_the_last_token(again[0])
            new = side.admit(again, cached)
            side.step(again, [r.num_tokens - cached for r in again], new)
            side.finish(again)
            add(totals["repeat"], side.traffic(cpu_s))
        layout = side.worker.link.layout
    finally:
        engine.close()
    return totals, layout


def run_whole_chain(daemon: DaemonProcess, layout: Layout, workload: Workload) -> dict[str, Traffic]:
    """The same waves through a plain client storing the whole chain at every step."""
    totals = {phase: Traffic() for phase in PHASES}
    with KvtierClient(daemon.address) as client:
        session = client.attach(layout, map_pool=False)

        def store(traffic: Traffic, request: Request, num_complete: int, request_id: str) -> None:
            hashes, tokens = request.block_hashes[:num_complete], request.all_token_ids[:num_complete * BLOCK_SIZE]
            acquired = session.acquire(request_id, hashes, 0, token_ids=tokens, for_store=True)
            held = acquired.num_t0_hit_blocks + acquired.num_loading_blocks
            traffic.rpcs += 2
            traffic.request_bytes += HASH_BYTES * len(hashes) + 4 * len(tokens)
            fresh = acquired.block_ids[held:num_complete]
            if fresh:
                committed_tokens = tokens[held * BLOCK_SIZE:]
                session.commit(request_id, fresh, hashes[held:], committed_tokens, hashes[held - 1] if held else None)
                traffic.rpcs += 1
                traffic.request_bytes += HASH_BYTES * len(fresh) + 4 * len(committed_tokens)
                traffic.stored_blocks += len(fresh)
            session.release(request_id)

        for wave in range(workload.num_waves):
            numbers = range(wave * CONCURRENCY, (wave + 1) * CONCURRENCY)
            requests = [Request(f"wave{wave}-{n}", prompt(n, PROMPT_TOKENS), BLOCK_SIZE) for n in numbers]
            for phase in PHASES:
                traffic, cpu_s = Traffic(), process_cpu_s(daemon.process.pid)
                if phase == "prefill":
                    for request in requests:
                        session.lookup(request.block_hashes, token_ids=request.all_token_ids)
                    computed = 0
                    for chunk in steps(0, PROMPT_TOKENS):
                        computed += chunk
                        for request in requests:
                            store(traffic, request, computed // BLOCK_SIZE, request.request_id)
                    for request in requests:
                        request.append_output(decoded_token(request))
                elif phase == "decode":
                    for _ in range(workload.decode_tokens):
                        for request in requests:
                            if len(request.all_token_ids) % BLOCK_SIZE == 0:  # the step computes a block's last token
                                store(traffic, request, len(request.all_token_ids) // BLOCK_SIZE, request.request_id)
                            request.append_output(decoded_token(request))
                else:  # vLLM's own cache served the prompt; the whole-chain store still Acquired it
                    for n in numbers:
                        again = Request(f"again{wave}-{n}", prompt(n, PROMPT_TOKENS), BLOCK_SIZE)
                        session.lookup(again.block_hashes, token_ids=again.all_token_ids)
                        store(traffic, again, len(again.block_hashes), again.request_id)
                traffic.daemon_cpu_s = process_cpu_s(daemon.process.pid) - cpu_s
                add(totals[phase], traffic)
    return totals


def add(total: Traffic, part: Traffic) -> None:
    total.stored_blocks += part.stored_blocks
    total.rpcs += part.rpcs
    total.request_bytes += part.request_bytes
    total.daemon_cpu_s += part.daemon_cpu_s


def combined(totals: dict[str, Traffic], phases: tuple[str, ...]) -> Traffic:
    total = Traffic()
    for phase in phases:
        add(total, totals[phase])
    return total


def ratio(baseline: float, ours: float) -> str:
    if math.isnan(baseline) or math.isnan(ours):
        return "-"
    return f"{baseline / ours:.2f}x" if ours else "inf"


def report(ours: dict[str, Traffic], baseline: dict[str, Traffic]) -> None:
    rows = []
    stored = ("prefill", "decode")
    for phase in (*PHASES, "prefill + decode"):
        mine = combined(ours, stored) if phase == "prefill + decode" else ours[phase]
        base = combined(baseline, stored) if phase == "prefill + decode" else baseline[phase]
        if phase == "repeat":
            per = [("store RPCs", mine.rpcs, base.rpcs), ("request bytes", mine.request_bytes, base.request_bytes),
                   ("daemon CPU ms", mine.daemon_cpu_s * 1e3, base.daemon_cpu_s * 1e3)]
            rows.append([phase, f"{mine.stored_blocks} / {base.stored_blocks}",
                         *(f"{m:,.0f} / {b:,.0f} (total)" for _, m, b in per), ratio(base.request_bytes,
                                                                                   mine.request_bytes)])
            continue
        rows.append([phase, f"{mine.stored_blocks} / {base.stored_blocks}",
                     f"{mine.per_block(mine.rpcs):.2f} / {base.per_block(base.rpcs):.2f}",
                     f"{mine.per_block(mine.request_bytes):,.0f} / {base.per_block(base.request_bytes):,.0f}",
                     f"{mine.per_block(mine.daemon_cpu_s) * 1e6:,.0f} / {base.per_block(base.daemon_cpu_s) * 1e6:,.0f}",
                     ratio(base.per_block(base.request_bytes), mine.per_block(mine.request_bytes))])
    _report.print_table(["phase", "stored blocks ours / whole chain", "RPCs per block", "request bytes per block",
                         "daemon CPU us per block", "bytes: x fewer"], rows)
    decode_bytes = ours["decode"].per_block(ours["decode"].request_bytes)
    decode_ratio = ratio(baseline["decode"].per_block(baseline["decode"].request_bytes), decode_bytes)
    goals = [(f"a block filled in decode sends itself and its parent only: {decode_bytes:,.0f} bytes per block, "
              f"at most {DECODE_BLOCK_BYTES} ({decode_ratio} fewer than the whole chain)",
              decode_bytes <= DECODE_BLOCK_BYTES),
             (f"no store RPC for prompts vLLM's own cache served ({ours['repeat'].rpcs} vs "
              f"{baseline['repeat'].rpcs}: {ours['repeat'].rpcs / max(baseline['repeat'].rpcs, 1):.2f}x the "
              f"whole chain's)", ours["repeat"].rpcs == 0)]
    _report.print_goals(goals)


def main(argv: list[str] | None = None) -> int:
    args = _report.parse_args(__doc__.splitlines()[0], argv)
    workload = QUICK if args.quick else FULL
    _report.print_header("the vLLM connector's store path vs a whole-chain store, per stored block", args.quick,
                         timing_note="counts: the connector's store_rpcs / store_request_bytes / stored_blocks; "
                                     "daemon CPU: /proc user + system of each daemon over each phase")
    print(f"workload: {workload.num_waves} waves of {CONCURRENCY} requests in lockstep; {PROMPT_TOKENS}-token "
          f"prompts in {CHUNK_TOKENS}-token chunks, blocks of {BLOCK_SIZE} tokens, {workload.decode_tokens} decode "
          f"tokens; then the prompts again from vLLM's own cache")
    with tempfile.TemporaryDirectory(prefix="kvsp-") as directory:
        ours_dir, base_dir = Path(directory, "ours"), Path(directory, "whole-chain")
        ours_dir.mkdir()
        base_dir.mkdir()
        args_for = dict(t0_bytes="64MiB", host_bytes="64MiB", ssd_bytes="64MiB", extra=ONE_LAYOUT)
        with DaemonProcess(small_daemon_args(str(ours_dir), **args_for)) as daemon:
            ours, layout = run_connector(daemon, workload)
        with DaemonProcess(small_daemon_args(str(base_dir), **args_for)) as daemon:
            baseline = run_whole_chain(daemon, layout, workload)
    report(ours, baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
