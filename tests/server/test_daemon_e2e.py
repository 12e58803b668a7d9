"""End to end: a real `kvtierd serve`, client processes and the client library."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest

from kvtierd.client import KvtierClient
from kvtierd.errors import InvalidArgument
from kvtierd.launch.daemon_process import (
    WRITE_THROUGH,
    DaemonProcess,
    python_module_command,
    small_daemon_args,
    wait_until,
)
from kvtierd.token_bytes import pack_token_ids
from tests.server.e2e_runner import LAYOUT, expected_block, prompt

RUNNER = os.path.join(os.path.dirname(__file__), "e2e_runner.py")


def run_runner(address: str, *args, token: str | None = None) -> dict:
    env = dict(os.environ, KVTIERD_ADDRESS=address, PYTHONPATH=os.path.dirname(RUNNER) + "/..")
    if token:
        env["KVTIERD_TOKEN"] = token
    done = subprocess.run([sys.executable, RUNNER, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def t0_stats(client: KvtierClient):
    pools = [p for p in client.stats().pools if p.layout.model_id == LAYOUT.model_id]
    assert len(pools) == 1
    return pools[0]


@pytest.fixture
def daemon(tmp_path):
    with DaemonProcess(small_daemon_args(str(tmp_path), extra=["--lease-s", "30"])) as process:
        yield process


@pytest.mark.slow  # two runner processes
def test_two_processes_share_a_prefix_through_the_mapped_pool(daemon):
    """The second process's prompt hits the first's blocks and reads the first's bytes."""
    first = run_runner(daemon.address, "compute", 1, 96, 64)
    second = run_runner(daemon.address, "compute", 2, 96, 64)
    assert first["num_hits"] == 0 and first["num_blocks"] == 24
    assert second["num_t0_hits"] == 16  # the 64 shared tokens
    assert second["num_mismatched"] == 0


def test_a_client_killed_with_sigkill_leaks_nothing(daemon):
    """Every reference a SIGKILLed runner held is reclaimed once: free blocks return to the total."""
    env = dict(os.environ, KVTIERD_ADDRESS=daemon.address, PYTHONPATH=os.path.dirname(RUNNER) + "/..")
    runner = subprocess.Popen([sys.executable, RUNNER, "hold", "5", "40"], env=env, stdout=subprocess.PIPE, text=True)
    num_held = json.loads(runner.stdout.readline())["num_held"]
    with KvtierClient(daemon.address) as client:
        before = t0_stats(client)
        assert before.num_blocks - before.num_free_blocks == num_held == 5 * 11
        runner.send_signal(signal.SIGKILL)
        runner.wait(10)
        assert wait_until(lambda: client.stats().num_sessions == 0, timeout_s=10)
        after = t0_stats(client)
        stats = client.stats()
    assert after.num_free_blocks == after.num_blocks
    assert stats.num_reclaimed_refs == num_held


def test_a_session_whose_lease_runs_out_is_reclaimed(tmp_path):
    """A session that never opens KeepAlive and stops calling is reclaimed after lease_s."""
    with DaemonProcess(small_daemon_args(str(tmp_path), extra=["--lease-s", "0.5"])) as daemon:
        with KvtierClient(daemon.address) as client:
            session = client.attach(LAYOUT, keepalive=False)
            session.acquire("r", [], num_extra_blocks=3)
            assert wait_until(lambda: client.stats().num_reclaimed_refs == 3, timeout_s=10)
            assert t0_stats(client).num_free_blocks == t0_stats(client).num_blocks


def test_put_survives_a_restart_in_t2_and_get_returns_the_bytes(tmp_path):
    """Blocks put before a SIGTERM come back from T2 after a restart, byte for byte."""
    args = small_daemon_args(str(tmp_path), extra=WRITE_THROUGH)
    tokens = prompt(3, 32)
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        hashes = client.attach(LAYOUT).namespace.hash_blocks(tokens)
        blocks = [(h, tokens[4 * i:4 * i + 4], expected_block(h, LAYOUT.bytes_per_block)) for i, h in enumerate(hashes)]
        assert client.put(LAYOUT, blocks).num_blocks == 8
        assert wait_until(lambda: [t.num_cached_blocks for t in t0_stats(client).tiers if t.tier == "t2"] == [8])
    assert daemon.process.returncode == 0
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        session = client.attach(LAYOUT)
        lookup = session.lookup(hashes, token_ids=tokens)
        assert (lookup.total.t0, lookup.total.t2) == (0, 8)
        got = client.get(LAYOUT, hashes, token_ids=tokens)
    assert [h for h, _ in got] == hashes
    assert all(data == expected_block(h, LAYOUT.bytes_per_block) for h, data in got)


def test_two_tenants_with_identical_prompts_never_hit_each_other(tmp_path):
    """Tenant B sees none of tenant A's blocks (lookup, acquire, get, events), A sees its own."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("acme a-token\nglobex g-token\n")
    with DaemonProcess(small_daemon_args(str(tmp_path), extra=["--tokens-file", str(tokens_file)])) as daemon:
        with KvtierClient(daemon.address, token="a-token") as a, KvtierClient(daemon.address, token="g-token") as b:
            events_b = b.events(LAYOUT)
            first = run_runner(daemon.address, "compute", 9, 64, 64, token="a-token")
            assert first["num_blocks"] == 16
            tokens = prompt(9, 64, 64)
            session_a, session_b = a.attach(LAYOUT), b.attach(LAYOUT)
            hashes = session_b.namespace.hash_blocks(tokens)
            assert session_a.tenant == "acme" and session_b.tenant == "globex"
            assert session_a.lookup(hashes).total.t0 == 16
            assert session_b.lookup(hashes).total.num_blocks == 0
            assert session_b.acquire("r", hashes).num_t0_hit_blocks == 0
            assert b.get(LAYOUT, hashes) == []
            session_b.release("r")
            events_b.cancel()
            assert not [e for e in events_b if e.kind == e.STORED]


def test_events_stream_reports_stored_blocks_with_client_hashes(daemon):
    with KvtierClient(daemon.address) as client:
        events = client.events(LAYOUT)
        session = client.attach(LAYOUT)
        tokens = prompt(4, 8)
        hashes = session.namespace.hash_blocks(tokens)
        acquired = session.acquire("r", hashes)
        session.commit("r", acquired.block_ids, hashes, tokens, None)
        stored = []
        for event in events:
            stored.append(event)
            if len(stored) == 2:
                break
        events.cancel()
    assert [(e.kind, e.block_hash, e.parent_hash) for e in stored] == [
        (stored[0].STORED, hashes[0], session.root_hash), (stored[0].STORED, hashes[1], hashes[0])]
    assert [e.block_id for e in stored] == acquired.block_ids


def test_tcp_with_tokens_on_an_ephemeral_port(tmp_path):
    """127.0.0.1:0: the printed port serves attach, put and get; a caller without token is refused."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("acme a-token\n")
    args = small_daemon_args(str(tmp_path), extra=["--tcp", "127.0.0.1:0", "--insecure-tcp",
                                                   "--tokens-file", str(tokens_file)])
    with DaemonProcess(args) as daemon:
        assert daemon.tcp_address.startswith("127.0.0.1:") and not daemon.tcp_address.endswith(":0")
        with KvtierClient(daemon.tcp_address, token="a-token") as client:
            session = client.attach(LAYOUT)
            tokens = prompt(5, 8)
            hashes = session.namespace.hash_blocks(tokens)
            data = [expected_block(h, LAYOUT.bytes_per_block) for h in hashes]
            client.put(LAYOUT, [(hashes[0], tokens[:4], data[0]), (hashes[1], tokens[4:], data[1])])
            assert client.get(LAYOUT, hashes, token_ids=pack_token_ids(tokens)) == list(zip(hashes, data))
        from kvtierd.errors import Unauthenticated
        with KvtierClient(daemon.tcp_address) as anonymous, pytest.raises(Unauthenticated):
            anonymous.stats()


def test_sigterm_with_clients_attached_exits_zero_and_removes_the_socket(tmp_path):
    """Open KeepAlive and Events streams end at SIGTERM instead of holding the exit for the
    whole grace period (600 s here); the sessions' blocks are released."""
    daemon = DaemonProcess(small_daemon_args(str(tmp_path), extra=["--set", "server.grace_s=600"]))
    socket_path = daemon.unix_address[len("unix://"):]
    assert oct(os.stat(socket_path).st_mode & 0o777) == "0o600"
    with KvtierClient(daemon.address) as client:
        events = client.events(LAYOUT)
        client.attach(LAYOUT).acquire("held", [], num_extra_blocks=2)
        assert daemon.stop(signal.SIGTERM, timeout_s=120) == 0
        events.cancel()
    assert not os.path.exists(socket_path)
    assert "kvtierd: stopped" in daemon.output()
    assert "released 2 block references of sessions open at shutdown" in daemon.output() or \
        "reclaimed 2 block references" in daemon.output()


def test_live_metrics_scrape_passes_promtool(daemon, promtool):
    run_runner(daemon.address, "compute", 1, 64, 0)
    with KvtierClient(daemon.address) as client:
        free = t0_stats(client).num_free_blocks
    scrape = urllib.request.urlopen(daemon.metrics_url, timeout=10).read()
    checked = subprocess.run([promtool, "check", "metrics"], input=scrape, capture_output=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    text = scrape.decode()
    assert f'kvtierd_t0_free_blocks{{model="{LAYOUT.model_id}"}} {float(free)}' in text
    assert 'kvtierd_rpc_total{code="OK",method="Acquire"} 1.0' in text


def test_a_busy_metrics_port_is_a_clear_error_and_leaves_no_socket(daemon, tmp_path):
    port = daemon.metrics_url.rsplit(":", 1)[1].split("/")[0]
    other = tmp_path / "other"
    other.mkdir()
    args = small_daemon_args(str(other), extra=["--metrics-port", port])
    done = subprocess.run(python_module_command("kvtierd.cli.kvtierd_main", "serve", *args), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"kvtierd: error: cannot serve metrics on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (other / "kvtierd.sock").exists()


def test_health_listener_serves_health_only_in_the_clear(tmp_path):
    """server.health_tcp: Kubernetes' gRPC probes get SERVING there; the KvTier API is not
    reachable through it (UNIMPLEMENTED), so plaintext reveals nothing but health."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with DaemonProcess(small_daemon_args(str(tmp_path), extra=["--health-tcp", "127.0.0.1:0"])) as daemon:
        assert daemon.health_address and daemon.health_address.startswith("127.0.0.1:")
        with grpc.insecure_channel(daemon.health_address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            for service in ("", "kvtierd.v1.KvTier"):
                status = check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary("/kvtierd.v1.KvTier/Stats")(b"", timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_get_after_a_restart_serves_t2_before_any_attach_or_put(tmp_path):
    """A restarted daemon has no pool for the layout until someone makes one; a Get that comes
    first still finds the blocks T2 holds (it opens the pool), byte for byte, and counts them."""
    args = small_daemon_args(str(tmp_path), extra=WRITE_THROUGH)
    tokens = prompt(5, 32)
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        hashes = client.attach(LAYOUT, map_pool=False).namespace.hash_blocks(tokens)
        blocks = [(h, tokens[4 * i:4 * i + 4], expected_block(h, LAYOUT.bytes_per_block)) for i, h in enumerate(hashes)]
        assert client.put(LAYOUT, blocks).num_blocks == 8
        assert wait_until(lambda: [t.num_cached_blocks for t in t0_stats(client).tiers if t.tier == "t2"] == [8])
    with DaemonProcess(args) as daemon, KvtierClient(daemon.address) as client:
        assert not client.stats().pools  # nothing attached, nothing put: no pool yet
        got = client.get(LAYOUT, hashes + [b"\x01" * 32], token_ids=tokens + [0, 0, 0, 0])
        stats = t0_stats(client)
    assert [h for h, _ in got] == hashes
    assert all(data == expected_block(h, LAYOUT.bytes_per_block) for h, data in got)
    assert stats.num_query_blocks == 9  # the unknown last block is asked for too
    assert [t.num_hit_blocks for t in stats.tiers if t.tier == "t2"] == [8]


def prefix_token_counts(metrics_url: str) -> tuple[float, float]:
    """kvtierd_prefix_query_tokens and its t0 hit tokens, summed over pools, from a scrape."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    query = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("kvtierd_prefix_query_tokens_total{"))
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvtierd_prefix_hit_tokens_total{") and 'tier="t0"' in line)
    return query, hits


def test_an_acquire_to_store_is_neither_a_query_nor_a_hit(tmp_path):
    """An engine stores what it computed by acquiring the chain first (for_store): the blocks it
    finds are not hits, in Stats and in the metrics; a load's Acquire of the same chain is."""
    tokens = prompt(11, 32)
    with DaemonProcess(small_daemon_args(str(tmp_path))) as daemon, KvtierClient(daemon.address) as client:
        session = client.attach(LAYOUT, map_pool=False)
        hashes = session.namespace.hash_blocks(tokens)
        first = session.acquire("compute", hashes, 0, token_ids=tokens)
        assert first.num_t0_hit_blocks == 0
        session.commit("compute", first.block_ids, hashes, tokens, None)
        session.release("compute")
        before = t0_stats(client)
        query_before, hits_before = prefix_token_counts(daemon.metrics_url)

        store = session.acquire("store", hashes, 0, token_ids=tokens, for_store=True)
        assert store.num_t0_hit_blocks == len(hashes)  # the caller still learns what is there
        session.release("store")
        after_store = t0_stats(client)
        assert after_store.num_query_blocks == before.num_query_blocks
        assert [t.num_hit_blocks for t in after_store.tiers] == [t.num_hit_blocks for t in before.tiers]
        assert prefix_token_counts(daemon.metrics_url) == (query_before, hits_before)

        load = session.acquire("load", hashes, 0, token_ids=tokens)
        session.release("load")
        after_load = t0_stats(client)
        assert load.num_t0_hit_blocks == len(hashes)
        assert after_load.num_query_blocks == before.num_query_blocks + len(hashes)
        t0_hits = {t.tier: t.num_hit_blocks for t in after_load.tiers}["t0"]
        assert t0_hits == {t.tier: t.num_hit_blocks for t in before.tiers}["t0"] + len(hashes)
        query, hits = prefix_token_counts(daemon.metrics_url)
        assert (query - query_before, hits - hits_before) == (len(tokens), len(tokens))


def test_a_lookup_counts_the_query_and_its_hits_once_and_the_load_counts_nothing_again(tmp_path):
    """An engine's first Lookup of a request counts, there, the blocks a full hit would load
    (num_query_blocks, of its first chain) and the hits it promises; the Acquire that loads them
    (query_counted) counts nothing; a Lookup naming more query blocks than its first chain holds is
    refused and counts nothing."""
    tokens = prompt(12, 32)
    with DaemonProcess(small_daemon_args(str(tmp_path))) as daemon, KvtierClient(daemon.address) as client:
        session = client.attach(LAYOUT, map_pool=False)
        hashes = session.namespace.hash_blocks(tokens)
        stored = session.acquire("compute", hashes[:5], 0, token_ids=tokens[:20], for_store=True)
        session.commit("compute", stored.block_ids, hashes[:5], tokens[:20], None)
        session.release("compute")
        before = t0_stats(client)
        query_before, hits_before = prefix_token_counts(daemon.metrics_url)

        with pytest.raises(InvalidArgument, match="num_query_blocks"):
            session.lookup(hashes, token_ids=tokens, chain_lengths=[6, 2], num_query_blocks=7)
        assert t0_stats(client).num_query_blocks == before.num_query_blocks

        answer = session.lookup(hashes, token_ids=tokens, num_query_blocks=len(hashes))
        assert answer.total.num_blocks == 5
        looked = t0_stats(client)
        assert looked.num_query_blocks == before.num_query_blocks + len(hashes)
        assert tier_hits(looked)["t0"] - tier_hits(before)["t0"] == 5
        assert prefix_token_counts(daemon.metrics_url) == (query_before + 4 * len(hashes), hits_before + 4 * 5)

        load = session.acquire("load", hashes[:5], 0, token_ids=tokens[:20], query_counted=True)
        session.release("load")
        assert load.num_t0_hit_blocks == 5
        after = t0_stats(client)
        assert (after.num_query_blocks, tier_hits(after)) == (looked.num_query_blocks, tier_hits(looked))
        assert prefix_token_counts(daemon.metrics_url) == (query_before + 4 * len(hashes), hits_before + 4 * 5)


def tier_hits(pool) -> dict[str, int]:
    return {t.tier: t.num_hit_blocks for t in pool.tiers}


def test_a_store_may_continue_a_chain_stored_before_naming_only_its_parent(tmp_path):
    """An engine stores the blocks a step filled: an Acquire of just those, naming the hash before
    them (parent_hash), and a Commit under that parent; the whole chain is then one prefix. A
    Commit naming another parent for the first block, or a malformed parent, is refused and
    changes nothing."""
    tokens = prompt(13, 32)
    with DaemonProcess(small_daemon_args(str(tmp_path))) as daemon, KvtierClient(daemon.address) as client:
        session = client.attach(LAYOUT, map_pool=False)
        hashes = session.namespace.hash_blocks(tokens)
        head = session.acquire("head", hashes[:3], 0, token_ids=tokens[:12], for_store=True)
        session.commit("head", head.block_ids, hashes[:3], tokens[:12], None)
        session.release("head")

        with pytest.raises(InvalidArgument, match="block hash"):
            session.acquire("bad", hashes[3:], 0, token_ids=tokens[12:], for_store=True, parent_hash=b"\x01")
        tail = session.acquire("tail", hashes[3:], 0, token_ids=tokens[12:], for_store=True, parent_hash=hashes[2])
        assert tail.num_t0_hit_blocks == 0
        with pytest.raises(InvalidArgument, match="parent_hash its Acquire named"):
            session.commit("tail", tail.block_ids, hashes[3:], tokens[12:], hashes[1])
        with pytest.raises(InvalidArgument, match="parent_hash its Acquire named"):
            session.commit("tail", tail.block_ids, hashes[3:], tokens[12:], None)  # the root
        assert session.lookup(hashes, token_ids=tokens).total.num_blocks == 3
        assert session.commit("tail", tail.block_ids, hashes[3:], tokens[12:], hashes[2]) == len(hashes) - 3
        session.release("tail")
        assert session.lookup(hashes, token_ids=tokens).total.num_blocks == len(hashes)
        stats = t0_stats(client)
        assert stats.num_free_blocks == stats.num_blocks  # nothing held (the refused Acquire held nothing)
