"""Write-through on a real `kvtierd serve`: a burst of Puts larger than T1 (and than T0) reaches T2
whole under T0 → T1 → T2 write-through, and a restarted daemon serves every block of it; a block
an edge could not copy down is counted in Stats, in `kvtierctl stats` and `health`, and in the
metrics (kvtierd_dropped_offload_blocks_total), never lost in silence."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from tests.conftest import REPO
from tests.server.e2e_runner import LAYOUT, expected_block, prompt
from tests.t2.test_ssd_reliability import fill, small_tmpfs  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)
T0_TO_T1_WRITE_THROUGH = ["--set", "policy.t0_to_t1=write_through"]  # T1 -> T2: write_through by default
SLOT_BYTES = 4096  # a slot of T1 and T2 holds one of LAYOUT's 1 KiB blocks, 4 KiB aligned
NUM_CHAINS, CHAIN_BLOCKS = 12, 4  # the burst: 48 blocks, 3x T0's 16


def put_chain(client: KvtierClient, seed: int, num_blocks: int) -> tuple[list[int], list[tuple]]:
    tokens = prompt(seed, num_blocks * LAYOUT.block_size)
    hashes = client.attach(LAYOUT, map_pool=False).namespace.hash_blocks(tokens)
    size = LAYOUT.block_size
    blocks = [(h, tokens[size * i:size * (i + 1)], expected_block(h, LAYOUT.bytes_per_block))
              for i, h in enumerate(hashes)]
    assert client.put(LAYOUT, blocks).num_blocks == num_blocks
    return tokens, blocks


def tier_row(client: KvtierClient, tier: str):
    pool, = client.stats().pools
    return next(t for t in pool.tiers if t.tier == tier)


def kvtierctl(daemon: DaemonProcess, command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "kvtierd.cli.kvtierctl", "--address", daemon.address, command],
                          capture_output=True, text=True, timeout=60)


def dropped_metric(daemon: DaemonProcess, edge: str) -> float:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    return next(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == "kvtierd_dropped_offload_blocks_total" and sample.labels["edge"] == edge)


def slow_disk(write_delay_s: float) -> dict:
    """DaemonProcess arguments for a daemon whose T2 writes each take `write_delay_s` first."""
    return {"env": {"SLOW_T2_WRITE_DELAY_S": str(write_delay_s), "PYTHONPATH": str(REPO)},
            "module": "tests.server.slow_t2_serve"}


@pytest.mark.parametrize("host_bytes, write_delay_s", [("64KiB", 0.0), ("16KiB", 0.05)],
                         ids=["host-64KiB", "host-16KiB-slow-disk"])
def test_a_burst_larger_than_t1_reaches_t2_whole_and_is_served_after_a_restart(tmp_path, host_bytes, write_delay_s):
    """12 chains x 4 blocks Put through T0 (16 blocks) and a smaller T1: every block reaches T2,
    none is counted dropped, and a daemon restarted on the same SSD directory serves all 48 byte
    for byte. With a slow disk T0 fills with blocks on their way down and the Puts wait for them."""
    args = small_daemon_args(str(tmp_path), t0_bytes="16KiB", host_bytes=host_bytes, ssd_bytes="4MiB",
                             extra=T0_TO_T1_WRITE_THROUGH)
    options = slow_disk(write_delay_s) if write_delay_s else {}
    with DaemonProcess(args, **options) as daemon, KvtierClient(daemon.address) as client:
        chains = [put_chain(client, seed, CHAIN_BLOCKS) for seed in range(NUM_CHAINS)]
        assert wait_until(lambda: tier_row(client, "t2").num_cached_blocks == NUM_CHAINS * CHAIN_BLOCKS,
                          timeout_s=60), tier_row(client, "t2")
        assert tier_row(client, "t1").capacity_bytes < NUM_CHAINS * CHAIN_BLOCKS * SLOT_BYTES  # a burst larger than T1
        t1, t2 = tier_row(client, "t1"), tier_row(client, "t2")
        assert t1.num_dropped_offload_blocks == t2.num_dropped_offload_blocks == 0
        stats = kvtierctl(daemon, "stats")
        assert "dropped on the way down" in stats.stdout and "T0->T1 0 blocks, T1->T2 0 blocks" in stats.stdout, \
            stats.stdout
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:  # the same SSD directory
        served = 0
        for tokens, blocks in chains:
            got = client.get(LAYOUT, [h for h, _, _ in blocks], token_ids=tokens)
            assert got == [(h, data) for h, _, data in blocks]
            served += len(got)
        assert served == NUM_CHAINS * CHAIN_BLOCKS


def test_a_write_through_that_may_not_wait_counts_every_block_it_drops(tmp_path):
    """policy.write_through_wait_s = 0 and a disk that takes a second a write: of one 8-block
    Put, T1 takes what its slots hold (pinned until the disk has them), the rest finds no slot
    and is dropped at once; Stats, the metric, kvtierctl stats and health count exactly those,
    and T2 ends up with exactly the others."""
    args = small_daemon_args(str(tmp_path), t0_bytes="16KiB", host_bytes="16KiB", ssd_bytes="4MiB",
                             extra=[*T0_TO_T1_WRITE_THROUGH, "--set", "policy.write_through_wait_s=0"])
    with DaemonProcess(args, **slow_disk(1.0)) as daemon, KvtierClient(daemon.address) as client:
        put_chain(client, 1, 8)
        num_t1_slots = tier_row(client, "t1").capacity_bytes // SLOT_BYTES
        assert 0 < num_t1_slots < 8
        assert wait_until(lambda: tier_row(client, "t1").num_dropped_offload_blocks == 8 - num_t1_slots,
                          timeout_s=30), tier_row(client, "t1")
        assert wait_until(lambda: tier_row(client, "t2").num_cached_blocks == num_t1_slots, timeout_s=60)
        assert tier_row(client, "t1").num_dropped_offload_blocks == 8 - num_t1_slots
        assert tier_row(client, "t2").num_dropped_offload_blocks == 0
        assert dropped_metric(daemon, "t0_t1") == 8 - num_t1_slots and dropped_metric(daemon, "t1_t2") == 0
        stats = kvtierctl(daemon, "stats")
        assert f"T0->T1 {8 - num_t1_slots} blocks, T1->T2 0 blocks" in stats.stdout, stats.stdout
        health = kvtierctl(daemon, "health")
        assert f"dropped on the way down (no room below within policy.write_through_wait_s, or refused): " \
               f"T0->T1 {8 - num_t1_slots} blocks" in health.stdout, health.stdout


def test_blocks_a_full_disk_refuses_are_counted_as_dropped_on_t1_to_t2(tmp_path, small_tmpfs):  # noqa: F811
    """T2 on a 2 MiB tmpfs that another writer fills: T2 stops admitting, and every block put
    afterwards is either on T2 or counted as dropped on T1 -> T2 (Stats, metric, kvtierctl)."""
    args = small_daemon_args(str(tmp_path), ssd_bytes="512KiB", extra=T0_TO_T1_WRITE_THROUGH)
    args[args.index("--ssd-dir") + 1] = str(small_tmpfs / "ssd")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        put_chain(client, 1, 8)
        assert wait_until(lambda: tier_row(client, "t2").num_cached_blocks == 8, timeout_s=30)
        fill(small_tmpfs)
        num_put = 8
        for seed in range(2, 40):  # until a write-through finds the disk full
            put_chain(client, seed, 8)
            num_put += 8
            if wait_until(lambda: not client.stats().pools[0].t2_admitting, timeout_s=2):
                break
        put_chain(client, 99, 8)  # offered to a T2 that no longer admits
        num_put += 8

        def accounted() -> bool:
            t2 = tier_row(client, "t2")
            return t2.num_cached_blocks + t2.num_dropped_offload_blocks == num_put

        assert wait_until(accounted, timeout_s=30), (tier_row(client, "t2"), num_put)
        num_dropped = tier_row(client, "t2").num_dropped_offload_blocks
        assert num_dropped >= 8 and dropped_metric(daemon, "t1_t2") == num_dropped
        assert tier_row(client, "t1").num_dropped_offload_blocks == 0
        assert f"T1->T2 {num_dropped:,} blocks" in kvtierctl(daemon, "stats").stdout
