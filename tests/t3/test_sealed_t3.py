"""[encryption] with a shared T3, as someone with the store's access sees it, on a real Redis Cluster:
daemons ("nodes": own sockets, pools, SSD and key directories) sharing one store, with the same
master key unless a test says otherwise. The store holds no block byte or prompt in the clear;
values swapped between tenants or blocks are misses, counted; a forget on node A makes node B serve
none of the tenant's old blocks at once while another tenant's are served; a node with another
master key reads nothing and replaces no key; values expire after retention.max_age_s; a master-key
rotation re-wraps the tenants' keys in the store in place."""

from __future__ import annotations

import contextlib
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from kvtierd.node.tenants import Tenant
from kvtierd.token_bytes import pack_token_ids
from tests.server.e2e_runner import LAYOUT, expected_block
from tests.server.test_encryption_daemon import MASTER_HEX, TOKENS, kvtierctl, kvtierd, master_key_file
from tests.t3.test_two_nodes import put_chain, t3_stats

pytestmark = pytest.mark.timeout(240)
OTHER_MASTER_HEX = "a7" * 32
RECORD_INFIX = b":tenant-key:"


def sealed_node(directory, seeds: str, key_file, *extra: str) -> DaemonProcess:
    """A daemon in `directory` with T2 and T3 sealed under `key_file`, writing through to T3 at once."""
    directory.mkdir(exist_ok=True)
    tokens = directory / "tokens"
    tokens.write_text(TOKENS)
    tokens.chmod(0o600)
    return DaemonProcess(small_daemon_args(str(directory), extra=[
        "--tokens-file", str(tokens), "--set", "server.admin_tenants=ops", "--set", "encryption.enabled=true",
        "--set", f"encryption.master_key_file={key_file}", "--set", f"remote.endpoints={seeds}",
        "--set", "policy.t0_to_t1=write_through", "--set", "remote.timeout_s=0.5", *extra]))


@contextlib.contextmanager
def two_sealed_nodes(tmp_path, seeds: str, b_master_hex: str = MASTER_HEX, *extra: str):
    (tmp_path / "keys-b").mkdir()
    a_key = master_key_file(tmp_path)
    b_key = master_key_file(tmp_path / "keys-b", content=b_master_hex + "\n")
    with sealed_node(tmp_path / "a", seeds, a_key, *extra) as a, sealed_node(tmp_path / "b", seeds, b_key, *extra) as b:
        yield a, b


def store_values(cluster) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    """Every block value and every tenant key record in the store, read directly: ({key: value}, {key: record})."""
    found = {}
    for port in cluster.ports:
        with contextlib.closing(cluster.node_client(port)) as node:
            found |= {key: node.get(key) for key in node.scan_iter(match="kvtierd:*")}
    return ({k: v for k, v in found.items() if RECORD_INFIX not in k},
            {k: v for k, v in found.items() if RECORD_INFIX in k})


def record_key(tenant: str) -> bytes:
    return b"kvtierd" + RECORD_INFIX + Tenant.named(tenant).tag.hex().encode()


def value_key(cluster, tenant: str, client_hash: bytes) -> bytes:
    pattern = f"*:{Tenant.named(tenant).tag.hex()}:{client_hash.hex()}"
    keys = [key for port in cluster.ports for key in cluster.node_client(port).scan_iter(match=pattern)]
    assert len(keys) == 1, keys
    return keys[0]


def swap_values(cluster, first: bytes, second: bytes) -> None:
    with contextlib.closing(cluster.cluster_client()) as client:
        one, other = client.get(first), client.get(second)
        assert one is not None and other is not None and one != other
        client.set(first, other)
        client.set(second, one)


def metric(daemon: DaemonProcess, name: str) -> float:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == name and s.labels.get("model") == LAYOUT.model_id)


def blocks_of(hashes: list[bytes]) -> list[tuple[bytes, bytes]]:
    return [(h, expected_block(h, LAYOUT.bytes_per_block)) for h in hashes]


def test_the_store_holds_no_block_or_prompt_in_the_clear_and_node_b_reads_them_back(tmp_path, redis_cluster):
    """Every value read straight from the store: none holds a block's first 64 bytes or a block's
    token ids; one key record per tenant, 61 bytes, no master key; node B gets node A's bytes."""
    with two_sealed_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as acme_a, KvtierClient(a.address, token="g-token") as globex_a, \
            KvtierClient(b.address, token="a-token") as acme_b:
        acme_tokens, acme_hashes = put_chain(acme_a, 1, 32)
        globex_tokens, globex_hashes = put_chain(globex_a, 2, 32)
        values, records = store_values(redis_cluster)
        assert len(values) == 16 and sorted(records) == sorted([record_key("acme"), record_key("globex")])
        assert all(len(record) == 61 and bytes.fromhex(MASTER_HEX) not in record for record in records.values())
        stored = b"\0".join(values.values())
        for data in (d for _, d in blocks_of(acme_hashes + globex_hashes)):
            assert data[:64] not in stored
        packed = pack_token_ids(acme_tokens) + pack_token_ids(globex_tokens)
        assert not any(packed[i:i + 16] in stored for i in range(0, len(packed), 16))  # no block's token ids
        assert acme_b.get(LAYOUT, acme_hashes, token_ids=acme_tokens) == blocks_of(acme_hashes)
        assert t3_stats(acme_b).num_hit_blocks == 8
    assert MASTER_HEX not in a.output() + b.output()


def test_values_swapped_between_tenants_or_blocks_are_misses_counted_never_served(tmp_path, redis_cluster):
    """Acme's and globex's block 2 of the same prompt swapped in the store, and acme's blocks 5 and
    6 of another chain: node B serves each chain up to the swapped value and no further; the three
    refusals are counted as unauthentic, the blocks not served as T3 misses."""
    with two_sealed_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as acme_a, KvtierClient(a.address, token="g-token") as globex_a, \
            KvtierClient(b.address, token="a-token") as acme_b, KvtierClient(b.address, token="g-token") as globex_b:
        tokens, hashes = put_chain(acme_a, 3, 32)
        assert put_chain(globex_a, 3, 32) == (tokens, hashes)  # the same client hashes, another tenant
        other_tokens, other_hashes = put_chain(acme_a, 4, 32)
        cluster = redis_cluster
        swap_values(cluster, value_key(cluster, "acme", hashes[2]), value_key(cluster, "globex", hashes[2]))
        swap_values(cluster, value_key(cluster, "acme", other_hashes[5]), value_key(cluster, "acme", other_hashes[6]))
        assert acme_b.get(LAYOUT, hashes, token_ids=tokens) == blocks_of(hashes[:2])
        assert globex_b.get(LAYOUT, hashes, token_ids=tokens) == blocks_of(hashes[:2])
        assert acme_b.get(LAYOUT, other_hashes, token_ids=other_tokens) == blocks_of(other_hashes[:5])
        assert t3_stats(acme_b).num_corrupt_blocks == 3
        assert metric(b, "kvtierd_t3_unauthentic_blocks_total") == 3
        assert (metric(b, "kvtierd_t3_hit_blocks_total"), metric(b, "kvtierd_t3_miss_blocks_total")) == (9, 15)


def test_forget_on_node_a_makes_node_b_serve_none_of_the_tenants_old_blocks(tmp_path, redis_cluster):
    """Node B read acme's chain 2 from T3 (it holds acme's key); acme is forgotten on node A: the
    store has no acme key any more, node B finds none of acme's chain 1 (Lookup and Get) while
    globex's chain is served whole; acme's next put makes a new key, and node B reads it."""
    with two_sealed_nodes(tmp_path, redis_cluster.seeds) as (a, b), \
            KvtierClient(a.address, token="a-token") as acme_a, KvtierClient(a.address, token="g-token") as globex_a, \
            KvtierClient(b.address, token="a-token") as acme_b, KvtierClient(b.address, token="g-token") as globex_b:
        tokens, hashes = put_chain(acme_a, 5, 32)
        tokens_2, hashes_2 = put_chain(acme_a, 6, 32)
        globex_tokens, globex_hashes = put_chain(globex_a, 7, 32)
        assert acme_b.get(LAYOUT, hashes_2, token_ids=tokens_2) == blocks_of(hashes_2)
        old_record = store_values(redis_cluster)[1][record_key("acme")]
        done = kvtierctl(a.address, "o-token", "forget", "--tenant", "acme")
        assert done.returncode == 0 and "data key destroyed" in done.stdout, done.stdout + done.stderr
        assert record_key("acme") not in store_values(redis_cluster)[1]
        assert len(store_values(redis_cluster)[0]) == 24  # acme's values are still there, sealed
        assert acme_b.attach(LAYOUT, map_pool=False).lookup(hashes, token_ids=tokens).total.t3 == 0
        assert acme_b.get(LAYOUT, hashes, token_ids=tokens) == []
        assert globex_b.get(LAYOUT, globex_hashes, token_ids=globex_tokens) == blocks_of(globex_hashes)
        new_tokens, new_hashes = put_chain(acme_a, 8, 32)
        new_record = store_values(redis_cluster)[1][record_key("acme")]
        assert new_record != old_record
        assert acme_b.get(LAYOUT, new_hashes, token_ids=new_tokens) == blocks_of(new_hashes)
        assert acme_b.get(LAYOUT, hashes, token_ids=tokens) == []  # the old blocks do not open under the new key


def test_a_node_with_another_master_key_reads_nothing_and_replaces_no_key(tmp_path, redis_cluster):
    """Node B's master key is not node A's: acme's chain put on A is a miss on B, counted as
    unauthentic; B's own acme blocks are not written to T3 (failed writes), and acme's key record
    in the store is still A's, byte for byte. Decided: misses, not a refused start (the store may
    be down at start, and nodes of two master keys may share a store for different tenants)."""
    with two_sealed_nodes(tmp_path, redis_cluster.seeds, OTHER_MASTER_HEX) as (a, b), \
            KvtierClient(a.address, token="a-token") as acme_a, KvtierClient(b.address, token="a-token") as acme_b:
        tokens, hashes = put_chain(acme_a, 9, 32)
        record = store_values(redis_cluster)[1][record_key("acme")]
        assert acme_b.get(LAYOUT, hashes, token_ids=tokens) == []
        assert metric(b, "kvtierd_t3_unauthentic_blocks_total") == 1
        own_tokens = [t + 1 for t in tokens]
        own_hashes = acme_b.attach(LAYOUT, map_pool=False).namespace.hash_blocks(own_tokens)
        assert acme_b.put(LAYOUT, [(h, own_tokens[4 * i:4 * i + 4], d)
                                   for i, (h, d) in enumerate(blocks_of(own_hashes))]).num_blocks == 8
        assert wait_until(lambda: t3_stats(acme_b).num_failed_writes == 8, timeout_s=20)
        values, records = store_values(redis_cluster)
        assert records == {record_key("acme"): record} and len(values) == 8
        assert OTHER_MASTER_HEX not in b.output() and "does not unwrap with this master key" in b.output()


def test_t3_values_expire_after_retention_max_age_s_and_key_records_do_not(tmp_path, redis_cluster):
    """retention.max_age_s = 3: every value carries the store's expiry (PTTL <= 3000 ms), the key
    record none; the store drops the values on its own, and node B then finds nothing."""
    with two_sealed_nodes(tmp_path, redis_cluster.seeds, MASTER_HEX, "--set", "retention.max_age_s=3") as (a, b), \
            KvtierClient(a.address, token="a-token") as acme_a, KvtierClient(b.address, token="a-token") as acme_b:
        tokens, hashes = put_chain(acme_a, 11, 32)
        values, records = store_values(redis_cluster)
        with contextlib.closing(redis_cluster.cluster_client()) as client:
            assert all(0 < client.pttl(key) <= 3000 for key in values) and len(values) == 8
            assert [client.pttl(key) for key in records] == [-1]
        assert wait_until(lambda: not store_values(redis_cluster)[0], timeout_s=15)
        assert acme_b.get(LAYOUT, hashes, token_ids=tokens) == []


def test_rewrap_keys_with_the_daemon_file_rewraps_the_shared_keys_in_place(tmp_path, redis_cluster):
    """Node A (master key 1) puts acme's and globex's chains, then stops. `kvtierd rewrap-keys` with a
    daemon file that names no store is refused in one line, changing nothing; with the file naming the
    store it re-wraps A's own key and both tenants' records in the store, values untouched: a node on
    key 2 reads both chains from T3, a node on key 1 none. Run again, nothing is left to re-wrap."""
    old_key = master_key_file(tmp_path)
    (tmp_path / "new").mkdir()
    new_key = master_key_file(tmp_path / "new", content=OTHER_MASTER_HEX + "\n")
    with sealed_node(tmp_path / "a", redis_cluster.seeds, old_key) as a, \
            KvtierClient(a.address, token="a-token") as acme_a, KvtierClient(a.address, token="g-token") as globex_a:
        acme_tokens, acme_hashes = put_chain(acme_a, 21, 32)
        globex_tokens, globex_hashes = put_chain(globex_a, 22, 32)
    values, records = store_values(redis_cluster)
    assert sorted(records) == sorted([record_key("acme"), record_key("globex")])
    rewrap = ["rewrap-keys", "--ssd-dir", str(tmp_path / "a" / "ssd"), "--old-key-file", str(old_key),
              "--new-key-file", str(new_key), "--config"]
    no_store = tmp_path / "no-store.toml"
    no_store.write_text("[remote]\nendpoints = \"\"\n")
    refused = kvtierd(*rewrap, str(no_store))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "names no store" in refused.stderr
    assert store_values(redis_cluster) == (values, records)
    config = tmp_path / "kvtierd.toml"
    config.write_text(f"[remote]\nendpoints = \"{redis_cluster.seeds}\"\n")
    done = kvtierd(*rewrap, str(config))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("re-wrapped 2 data key(s)")  # A's own (T2), unchanged by the refusal
    assert "shared store: re-wrapped 2 tenant key(s); 0 already under the new key" in done.stdout
    new_values, new_records = store_values(redis_cluster)
    assert new_values == values and sorted(new_records) == sorted(records)
    assert all(new_records[key] != records[key] and len(new_records[key]) == 61 for key in records)
    with sealed_node(tmp_path / "b", redis_cluster.seeds, new_key) as b, \
            KvtierClient(b.address, token="a-token") as acme_b, KvtierClient(b.address, token="g-token") as globex_b:
        assert acme_b.get(LAYOUT, acme_hashes, token_ids=acme_tokens) == blocks_of(acme_hashes)
        assert globex_b.get(LAYOUT, globex_hashes, token_ids=globex_tokens) == blocks_of(globex_hashes)
    with sealed_node(tmp_path / "c", redis_cluster.seeds, old_key) as c, \
            KvtierClient(c.address, token="a-token") as acme_c:
        assert acme_c.get(LAYOUT, acme_hashes, token_ids=acme_tokens) == []
    again = kvtierd(*rewrap, str(config))
    assert again.returncode == 0 and again.stdout.startswith("re-wrapped 0 data key(s)"), again.stderr
    assert "shared store: re-wrapped 0 tenant key(s); 2 already under the new key" in again.stdout
    assert MASTER_HEX not in done.stdout + done.stderr + again.stdout + again.stderr
