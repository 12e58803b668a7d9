"""The benchmarks run (a quick round each) and print our figure, the baseline and the ratio.

Not a timing assertion: the figures are noise on a shared machine; this keeps the scripts alive.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script, num_rows", [("bench_block_index.py", 7), ("bench_hashing.py", 8), ("bench_ssd_tier.py", 4),
                                              ("bench_tier_copy.py", 2)])
def test_benchmark_prints_ratios(script, num_rows):
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick"], capture_output=True, text=True,
                         check=True, timeout=300).stdout
    verdict_rows = [line for line in out.splitlines() if re.search(r"\b(PASS|MISS)$", line)]
    assert len(verdict_rows) == num_rows, out
    assert all(re.search(r"\d+\.\d+x", line) for line in verdict_rows), out
