"""The Redis Cluster harness the T3 tests run on is the real thing: 16384 slots over 3 masters, keys
spread over all of them, a killed master fails only its own slots, credentials and TLS enforced."""

from __future__ import annotations

import contextlib

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.t3.redis_cluster import (
    NUM_SLOTS,
    keys_owned_by,
    kill_node,
    owner_port,
    running_single,
    wait_node_marked_failed,
)

pytestmark = pytest.mark.cluster  # every test here starts redis-server

NO_RETRY = Retry(NoBackoff(), 0)  # redis-py retries an AuthenticationError (a ConnectionError) with backoff


def node_get(node: redis.Redis, keys: list[bytes]) -> list:
    """GET of keys in different slots of one node (MGET needs them in one slot)."""
    pipeline = node.pipeline(transaction=False)
    for key in keys:
        pipeline.get(key)
    return pipeline.execute()


def test_16384_slots_over_three_masters_every_node_agrees(redis_cluster):
    maps = [redis_cluster.read_slot_ranges(port) for port in redis_cluster.ports]
    assert all(slot_map == maps[0] for slot_map in maps), maps
    ranges = sorted(maps[0])
    assert {port for _, _, port in ranges} == set(redis_cluster.ports) and len(redis_cluster.ports) == 3
    assert ranges[0][0] == 0 and ranges[-1][1] == NUM_SLOTS - 1
    assert all(previous[1] + 1 == following[0] for previous, following in zip(ranges, ranges[1:])), ranges
    with contextlib.closing(redis_cluster.cluster_client()) as client:
        assert sorted(node.port for node in client.get_primaries()) == redis_cluster.ports
        info = client.cluster_info(target_nodes=redis.RedisCluster.RANDOM)
        assert info["cluster_state"] == "ok" and int(info["cluster_size"]) == 3


def test_keys_spread_over_all_three_masters_and_each_lives_on_its_slot_owner(redis_cluster):
    keys = [f"block:{i}".encode() for i in range(300)]
    with contextlib.closing(redis_cluster.cluster_client()) as client:
        pipeline = client.pipeline()
        for key in keys:
            pipeline.set(key, key[::-1])
        assert pipeline.execute() == [True] * len(keys)
    assert all(owner_port(redis_cluster, key) == redis_cluster.key_owner(key) for key in keys[:5])  # live == formed
    per_node = {port: [key for key in keys if redis_cluster.key_owner(key) == port] for port in redis_cluster.ports}
    assert all(len(owned) > 50 for owned in per_node.values()), {p: len(k) for p, k in per_node.items()}
    for port, owned in per_node.items():
        with contextlib.closing(redis_cluster.node_client(port)) as node:
            assert node.dbsize() == len(owned)
            assert node_get(node, owned) == [key[::-1] for key in owned]
            stranger = next(key for key in keys if key not in owned)
            with pytest.raises(redis.exceptions.MovedError, match=f":{owner_port(redis_cluster, stranger)}$"):
                node.get(stranger)  # MOVED <slot> 127.0.0.1:<owner>


def test_a_killed_master_fails_only_its_own_slots(redis_cluster):
    victim, *survivors = redis_cluster.ports
    owned = {port: keys_owned_by(redis_cluster, port, 20, prefix="kill") for port in redis_cluster.ports}
    for port, keys in owned.items():
        with contextlib.closing(redis_cluster.node_client(port)) as node:
            pipeline = node.pipeline(transaction=False)
            for key in keys:
                pipeline.set(key, b"v" + key)
            assert pipeline.execute() == [True] * len(keys)

    slots = kill_node(redis_cluster, victim)
    assert slots == redis_cluster.slots_of(victim) and slots, slots
    assert not redis_cluster.nodes[victim].alive()
    with contextlib.closing(redis_cluster.node_client(victim, socket_connect_timeout=2)) as dead:
        with pytest.raises(redis.ConnectionError):
            dead.ping()

    wait_node_marked_failed(redis_cluster, victim)
    for port in survivors:
        with contextlib.closing(redis_cluster.node_client(port)) as node:
            info = node.execute_command("CLUSTER INFO")
            # --cluster-require-full-coverage no: the cluster stays up with the victim's slots failed.
            assert info["cluster_state"] == "ok", info
            assert int(info["cluster_slots_fail"]) == sum(last - first + 1 for first, last in slots), info
            assert node_get(node, owned[port]) == [b"v" + key for key in owned[port]]
            with pytest.raises(redis.exceptions.MovedError, match=f":{victim}$"):
                node.get(owned[victim][0])  # still the victim's slot: nobody else serves it
    with contextlib.closing(redis_cluster.cluster_client(socket_timeout=5)) as client:
        assert client.get(owned[survivors[0]][0]) == b"v" + owned[survivors[0]][0]


def test_an_acl_user_password_is_enforced(make_redis_cluster):
    cluster = make_redis_cluster(username="kvtier", password="t3-secret")
    port = cluster.ports[0]
    with contextlib.closing(redis.Redis(port=port, retry=NO_RETRY)) as anonymous:
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()  # the default user is off: NOAUTH
    with contextlib.closing(redis.Redis(port=port, username="kvtier", password="wrong", retry=NO_RETRY)) as wrong:
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
    with contextlib.closing(redis.Redis(port=port, password="t3-secret", retry=NO_RETRY)) as default_user:
        with pytest.raises(redis.AuthenticationError):
            default_user.ping()
    with contextlib.closing(cluster.cluster_client()) as client:
        assert client.set(b"x", b"1") and client.get(b"x") == b"1"
        assert client.acl_whoami() == "kvtier"


def test_tls_cluster_serves_only_tls_clients_that_trust_its_ca(make_redis_cluster, tmp_path):
    cluster = make_redis_cluster(password="pw", tls_dir=tmp_path / "tls")
    with contextlib.closing(cluster.cluster_client()) as client:  # ssl=True, ssl_ca_certs=the CA
        keys = [f"tls:{i}".encode() for i in range(30)]
        client.mset_nonatomic({key: key for key in keys})
        assert client.mget_nonatomic(keys) == keys
    with contextlib.closing(redis.Redis(port=cluster.ports[0], password="pw", socket_timeout=5,
                                        retry=NO_RETRY)) as plain:
        with pytest.raises(redis.ConnectionError):
            plain.ping()
    with contextlib.closing(redis.Redis(port=cluster.ports[0], password="pw", ssl=True, socket_timeout=5,
                                        retry=NO_RETRY)) as untrusted:
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
            untrusted.ping()


def test_redis_single_is_a_plain_server(redis_single):
    (port,) = redis_single.ports
    with contextlib.closing(redis_single.node_client(port)) as client:
        assert client.info("server")["redis_mode"] == "standalone"
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert client.config_get("save") == {"save": ""} and client.config_get("appendonly")["appendonly"] == "no"
        client.set(b"a", b"b")
        assert client.get(b"a") == b"b"


def test_teardown_stops_the_servers_even_when_the_test_fails(tmp_path):
    with pytest.raises(RuntimeError, match="the test failed"):
        with running_single(tmp_path / "single") as server:
            (node,) = server.nodes.values()
            assert node.alive()
            raise RuntimeError("the test failed")
    assert not node.alive() and node.process.returncode is not None


def test_a_failed_install_fails_the_test_rather_than_skipping(tmp_path, monkeypatch):
    import scripts.redis_cluster
    import tests.t3.redis_cluster

    broken = tmp_path / "install-redis-server"
    broken.write_text("#!/bin/sh\necho 'apt-get download redis-tools failed' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(scripts.redis_cluster, "INSTALL_SCRIPT", broken)
    monkeypatch.setattr(tests.t3.redis_cluster, "_installed", False)
    with pytest.raises(pytest.fail.Exception, match="apt-get download redis-tools failed"):
        with running_single(tmp_path / "never"):
            pass
