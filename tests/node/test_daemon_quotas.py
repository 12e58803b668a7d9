"""Per-tenant quotas against a real daemon: T0 refuses beyond the quota and changes nothing;
T1 keeps a tenant within its bytes by recycling the tenant's own slots."""

from __future__ import annotations

import pytest

from kvtierd.client import KvtierClient
from kvtierd.errors import ResourceExhausted
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from tests.server.e2e_runner import LAYOUT, expected_block, prompt

SLOT_STRIDE = 4096  # host slots are 4 KiB aligned; a 1 KiB block takes one


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    directory = tmp_path_factory.mktemp("quotas")
    tokens = directory / "tokens"
    tokens.write_text("acme a-token\nglobex g-token\n")
    extra = ["--tokens-file", str(tokens), "--set", "quotas.acme.t0_bytes=8KiB",
             "--set", f"quotas.acme.t1_bytes={4 * SLOT_STRIDE}", "--set", "policy.t0_to_t1=write_through",
             "--set", "ssd.directory="]
    with DaemonProcess(small_daemon_args(str(directory), extra=extra)) as process:
        yield process


def pool_stats(client):
    pool, = client.stats().pools
    return pool


def test_t0_quota_refuses_beyond_and_changes_nothing(daemon):
    with KvtierClient(daemon.address, token="a-token") as acme, KvtierClient(daemon.address, token="g-token") as globex:
        session = acme.attach(LAYOUT)
        session.acquire("r1", [], num_extra_blocks=6)
        before = pool_stats(acme)
        with pytest.raises(ResourceExhausted, match="acme.*device quota"):
            session.acquire("r2", [], num_extra_blocks=3)
        with pytest.raises(ResourceExhausted, match="device quota"):
            session.fork("r1", "r1-child")
        with pytest.raises(ResourceExhausted, match="device quota"):
            session.append_blocks("r1", 3)
        assert pool_stats(acme) == before
        globex.attach(LAYOUT).acquire("g", [], num_extra_blocks=20)  # another tenant: not limited
        session.release("r1")
        assert len(session.acquire("r3", [], num_extra_blocks=8).block_ids) == 8


def test_t1_quota_keeps_a_tenant_within_its_bytes(daemon):
    tokens = prompt(11, 32)  # 8 blocks
    with KvtierClient(daemon.address, token="a-token") as acme, KvtierClient(daemon.address, token="g-token") as globex:
        def t1_slots():  # (slots used, slots holding a READY block)
            t1 = next(t for t in pool_stats(acme).tiers if t.tier == "t1")
            return t1.used_bytes // SLOT_STRIDE, t1.num_cached_blocks

        def settled(num_slots):
            """T1's used slots once the Put's write-through has landed. The Put's commit reserves
            its T1 slots (STORING: used, not yet cached) before Put answers; once every used slot
            holds a READY block, no write-through of it is pending."""
            wait_until(lambda: (lambda used, ready: used >= num_slots and used == ready)(*t1_slots()))
            return t1_slots()[0]

        for client, num_slots in ((acme, 4), (globex, 4 + 8)):  # acme keeps 4 slots of its 8 blocks
            hashes = client.attach(LAYOUT).namespace.hash_blocks(tokens)
            blocks = [(h, tokens[4 * i:4 * i + 4], expected_block(h, LAYOUT.bytes_per_block))
                      for i, h in enumerate(hashes)]
            assert client.put(LAYOUT, blocks).num_blocks == 8
            assert settled(num_slots) == num_slots
