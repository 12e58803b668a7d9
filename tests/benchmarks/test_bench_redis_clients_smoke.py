"""benchmarks/bench_redis_clients.py runs (--quick) on its own Redis Cluster and prints every client's row.

Not a timing assertion: the figures are noise on a shared machine; this keeps the script alive. A missing
redis-server is installed first (scripts/install-redis-server), and a failed install fails the test.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.cluster
def test_bench_redis_clients_prints_a_row_per_client_and_op():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_redis_clients.py"), "--quick"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if re.search(r"\d\.\d\dx\s+\(\d+\.\d\dx\)$", line)]
    for client in ("(a) RedisCluster pipeline", "(c) per-node pipelines", "(e) redis.asyncio"):
        for op in ("SET", "GET"):
            assert any(line.startswith(client) and f" {op} " in line for line in rows), done.stdout
    assert any(line.startswith("(a)") and " SET " in line and "1.00x" in line for line in rows), done.stdout
    assert sum(line.startswith("[extra]") for line in rows) == 3, done.stdout
    assert "cluster: redis-server 7." in done.stdout, done.stdout
