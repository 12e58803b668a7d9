"""`kvtierd serve` with retention.max_age_s: the daemon's sweep reclaims T2 blocks past the limit
without anyone asking for them, counts them as left "expired", and leaves the tiers above alone."""

from __future__ import annotations

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import WRITE_THROUGH, DaemonProcess, small_daemon_args, wait_until
from tests.server.e2e_runner import LAYOUT, expected_block, prompt
from tests.server.test_daemon_e2e import t0_stats


def tier(client: KvtierClient, name: str):
    return next(t for t in t0_stats(client).tiers if t.tier == name)


def test_the_sweep_reclaims_t2_blocks_past_the_age_limit(tmp_path):
    """Eight blocks written through to T2 with a 2 s limit: T2 gives all eight back as "expired"
    (waited for, up to 60 s), while T0 still serves them."""
    args = small_daemon_args(str(tmp_path), extra=[*WRITE_THROUGH, "--set", "retention.max_age_s=2"])
    tokens = prompt(11, 32)
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        hashes = client.attach(LAYOUT, map_pool=False).namespace.hash_blocks(tokens)
        blocks = [(h, tokens[4 * i:4 * i + 4], expected_block(h, LAYOUT.bytes_per_block)) for i, h in enumerate(hashes)]
        assert client.put(LAYOUT, blocks).num_blocks == 8
        assert wait_until(lambda: tier(client, "t2").num_cached_blocks == 8)
        assert wait_until(lambda: tier(client, "t2").num_cached_blocks == 0, timeout_s=60)
        left = {entry.reason: entry.num_blocks for entry in tier(client, "t2").left}
        assert left.get("expired") == 8
        assert tier(client, "t0").num_cached_blocks == 8
        assert [h for h, _ in client.get(LAYOUT, hashes, token_ids=tokens)] == hashes
