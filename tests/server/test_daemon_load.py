"""Load: several client processes for a bounded time doing attach / acquire / commit / release
with shared prefixes against one daemon; afterwards no error and every block is free again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until

RUNNER = os.path.join(os.path.dirname(__file__), "e2e_runner.py")
NUM_WORKERS = 4
DURATION_S = 5.0
SHARED_TOKENS = 192  # 48 blocks every worker shares; 16 blocks of its own after them


@pytest.mark.slow  # many clients, thousands of calls
def test_concurrent_clients_with_shared_prefixes_leave_no_block_held(tmp_path):
    # 512 blocks: the working set (48 shared + 4 workers x 7 prompts x 16 own) does not fit: T0 evicts
    args = small_daemon_args(str(tmp_path), t0_bytes="512KiB", host_bytes="1MiB", ssd_bytes="4MiB")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(RUNNER) + "/..")
    with DaemonProcess(args) as daemon:
        env["KVTIERD_ADDRESS"] = daemon.address
        workers = [subprocess.Popen([sys.executable, RUNNER, "load", str(i), str(DURATION_S), str(SHARED_TOKENS)],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for i in range(NUM_WORKERS)]
        results = []
        for worker in workers:
            out, err = worker.communicate(timeout=120)
            assert worker.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
        with KvtierClient(daemon.address) as client:
            assert wait_until(lambda: client.stats().num_sessions == 0, timeout_s=10)
            stats = client.stats()
    pool, = stats.pools
    assert pool.num_free_blocks == pool.num_blocks == 512
    assert stats.num_reclaimed_refs == 0  # every worker released what it held
    assert sum(r["num_mismatched"] for r in results) == 0  # every hit held the bytes its hash names
    num_requests = sum(r["num_requests"] for r in results)
    assert all(r["num_requests"] > 0 for r in results)
    assert sum(r["num_hit_blocks"] for r in results) >= 48 * (num_requests - NUM_WORKERS)  # the shared prefix hit
    t0 = next(t for t in pool.tiers if t.tier == "t0")
    assert t0.num_hit_blocks > 0
    print(f"{num_requests} requests from {NUM_WORKERS} processes in {DURATION_S} s")
