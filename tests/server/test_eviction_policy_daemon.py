"""[policy] t0_eviction / t1_eviction / t2_eviction: checked at load (a bad name: exit 2, one line
naming the key and the valid names), and against a real `kvtierd serve`: with T1 under S3-FIFO a
chain read twice from T1 survives a flood of one-off chains that evicts it under LRU."""

from __future__ import annotations

import subprocess

import pytest

from kvtierd.client import KvtierClient
from kvtierd.errors import InvalidArgument
from kvtierd.launch.daemon_process import READY_LINE, DaemonProcess, python_module_command, wait_until
from kvtierd.server.config_loader import load_config
from kvtierd.tiering.tier_config import TierConfig
from tests.server.test_retention_daemon import chain, exact, flood, put, small_args, where


@pytest.mark.parametrize("key", ["policy.t0_eviction", "policy.t1_eviction", "policy.t2_eviction"])
def test_a_bad_eviction_name_is_refused_naming_the_key_and_the_valid_names(key):
    with pytest.raises(InvalidArgument, match=f"{key} must be one of lru, s3fifo; got 'lfu'"):
        load_config(environ={}, overrides={key: "lfu"})


def test_eviction_names_reach_each_tier_config():
    config = load_config(environ={"KVTIERD_POLICY_T2_EVICTION": "s3fifo"}, overrides={"policy.t1_eviction": "s3fifo"})
    tiers = TierConfig.of_sections(config.host, config.ssd, config.policy, config.remote)
    assert (tiers.t0_eviction, tiers.t1_eviction, tiers.t2_eviction) == ("lru", "s3fifo", "s3fifo")


def test_kvtierd_serve_refuses_a_bad_eviction_name_with_exit_2(tmp_path):
    command = python_module_command("kvtierd.cli.kvtierd_main", "serve",
                                    *small_args(tmp_path, "--set", "policy.t1_eviction=arc"))
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stdout + done.stderr
    assert READY_LINE not in done.stdout
    assert done.stderr.splitlines() == [
        "kvtierd: error: policy.t1_eviction must be one of lru, s3fifo; got 'arc'"]


@pytest.mark.parametrize("eviction, survives", [("lru", False), ("s3fifo", True)])
def test_a_chain_read_twice_from_t1_survives_a_flood_only_under_s3fifo(tmp_path, eviction, survives):
    """An 8-block chain is evicted from T0 into T1 (64 slots) and read from there twice; 160 blocks of
    one-off chains then pass through T0 into T1. T2 takes nothing (policy.t1_to_t2 off)."""
    args = small_args(tmp_path, "--set", "policy.t1_to_t2=off", "--set", f"policy.t1_eviction={eviction}")
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        hashes, tokens = chain(client, 1, 8)
        put(client, hashes, tokens)
        for _ in range(2):
            client.evict(tiers=["t0"])  # copied down to T1 (in the background): the read below comes from T1
            assert wait_until(lambda: where(client, hashes, tokens).total.t1 == 8)
            assert exact(client, hashes, tokens)
        client.evict(tiers=["t0"])

        flood(client, 100)  # 20 chains of 8 blocks

        found = where(client, hashes, tokens).total
        assert found.t0 == 0
        assert found.t1 == (8 if survives else 0)
        if survives:
            assert exact(client, hashes, tokens)


def test_the_start_up_lines_name_a_tier_off_lru(tmp_path):
    args = small_args(tmp_path, "--set", "policy.t2_eviction=s3fifo")
    with DaemonProcess(args) as daemon:
        assert "eviction T0 lru, T1 lru, T2 s3fifo" in daemon.output(), daemon.output()
