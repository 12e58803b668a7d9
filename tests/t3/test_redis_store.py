"""T3's store client on real servers: keys on the master that owns their slot; a killed, stopped
(SIGSTOP) or refusing node gives misses for its keys only, within a bounded time, and its breaker
opens after breaker_failures calls (then nothing waits on it) and closes after a successful probe;
credentials and TLS as configured; nothing ever raises for the store's sake."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading

import pytest
from redis.crc import key_slot

from kvtierd.t3.circuit_breaker import BreakerState
from kvtierd.t3.redis_store import RedisStore
from kvtierd.t3.remote_config import RemoteConfig
from tests.t3.redis_cluster import keys_owned_by, kill_node, owner_port, wait_until

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 0.25
WRONG_PASSWORD = "not-the-secret-5e1d"


def config_of(deployment, **fields) -> RemoteConfig:
    """A RemoteConfig on every node of `deployment`, with its credentials (and CA) unless `fields` say."""
    defaults = dict(username=deployment.username or "", password=deployment.password or "", timeout_s=TIMEOUT_S)
    if deployment.tls is not None:
        defaults.update(tls=True, tls_ca_file=str(deployment.tls.ca_cert))
    return RemoteConfig(tuple((deployment.host, port) for port in deployment.ports), **{**defaults, **fields})


@contextlib.contextmanager
def open_store(deployment, **fields):
    store = RedisStore(config_of(deployment, **fields))
    try:
        yield store
    finally:
        store.close()


def value_of(key: bytes) -> bytes:
    return b"value of " + key + bytes(range(256))


def bounded(call, limit_s: float = 10 * TIMEOUT_S):
    """`call()` on a thread: it must finish within `limit_s` (what a hung store call would not); its result."""
    result, error = [], []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as e:  # re-raised on the test's thread
            error.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"the store call did not return within {limit_s:g} s"
    if error:
        raise error[0]
    return result[0]


@contextlib.contextmanager
def stopped(deployment, port: int):
    """The node on `port` frozen with SIGSTOP (it accepts connections and never answers); SIGCONT always."""
    pid = deployment.nodes[port].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def keys_per_node(cluster, count: int, prefix: str) -> dict[int, list[bytes]]:
    return {port: keys_owned_by(cluster, port, count, prefix=prefix) for port in cluster.ports}


def dead_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens once closed


@pytest.fixture
def flushed_cluster(redis_cluster_module):
    """The module's cluster (nothing killed in it), emptied after each test."""
    yield redis_cluster_module
    for port in redis_cluster_module.ports:
        with contextlib.closing(redis_cluster_module.node_client(port)) as node:
            node.flushall()


# ------------------------------------------------------------------------------------------------ routing


def test_each_key_is_written_on_the_master_that_owns_its_slot(flushed_cluster):
    """300 keys set through the store: each lives on owner_port(key) and on no other master; the store
    reads them back exactly, and asks all 3 masters."""
    cluster = flushed_cluster
    keys = [b"kvtierd:route:%d" % i for i in range(300)]
    with open_store(cluster) as store:
        assert store.set([(key, value_of(key)) for key in keys]) == [True] * len(keys)
        assert store.mode == "cluster"
        assert store.get(keys) == [value_of(key) for key in keys]
        assert store.exists(keys) == [True] * len(keys)
        health = store.health()
        assert (health.mode, health.state, health.num_nodes, health.num_errors) == ("cluster", "closed", 3, 0)
    owners = {key: owner_port(cluster, key) for key in keys}
    for port in cluster.ports:
        with contextlib.closing(cluster.node_client(port)) as node:
            here = sorted(node.keys())
            assert here == sorted(key for key in keys if owners[key] == port)
            assert len(here) > 50  # no hash tags: keys spread over every master


def test_absent_keys_are_misses_among_hits_in_order(flushed_cluster):
    """get/exists answer per key, in the caller's order: None/False exactly where nothing was set."""
    keys = [b"kvtierd:mixed:%d" % i for i in range(40)]
    present = keys[::3]
    with open_store(flushed_cluster) as store:
        assert store.set([(key, value_of(key)) for key in present]) == [True] * len(present)
        assert store.get(keys) == [value_of(key) if key in present else None for key in keys]
        assert store.exists(keys) == [key in present for key in keys]
        assert store.get([]) == [] and store.exists([]) == [] and store.set([]) == []


def test_set_with_a_ttl_gives_the_key_that_ttl(flushed_cluster):
    """ttl_ms > 0: every key set carries a TTL of at most ttl_ms; 0: none."""
    cluster = flushed_cluster
    with open_store(cluster) as store:
        store.set([(b"kvtierd:ttl:a", b"1")], ttl_ms=100_000)
        store.set([(b"kvtierd:ttl:b", b"2")], ttl_ms=0)
    with contextlib.closing(cluster.cluster_client()) as client:
        assert 99_000 < client.pttl(b"kvtierd:ttl:a") <= 100_000
        assert client.ttl(b"kvtierd:ttl:b") == -1  # no expiry


def test_a_single_redis_in_auto_mode_is_detected_as_single(redis_single):
    """mode auto on a plain redis-server: "single", and get/exists/set work on it."""
    keys = [b"kvtierd:single:%d" % i for i in range(20)]
    with open_store(redis_single) as store:
        assert store.mode == "unknown"  # nobody asked yet
        assert store.set([(key, value_of(key)) for key in keys[:10]]) == [True] * 10
        assert store.mode == "single" and store.health().mode == "single"
        assert store.get(keys) == [value_of(key) for key in keys[:10]] + [None] * 10
        assert store.exists(keys) == [True] * 10 + [False] * 10
        assert store.health().num_errors == 0 and store.health().num_nodes == 1
    with contextlib.closing(redis_single.node_client(redis_single.ports[0])) as node:
        assert sorted(node.keys()) == sorted(keys[:10])


def test_mode_single_configured_works_on_a_single_redis(redis_single):
    with open_store(redis_single, mode="single") as store:
        assert store.set([(b"a", b"1")]) == [True] and store.get([b"a", b"b"]) == [b"1", None]


def test_mode_cluster_on_a_single_redis_is_misses_and_errors_never_raises(redis_single):
    """Configured "cluster" against a non-cluster server: every call is a miss (counted), none raises."""
    with contextlib.closing(redis_single.node_client(redis_single.ports[0])) as node:
        node.set(b"a", b"1")
    with open_store(redis_single, mode="cluster") as store:
        assert store.get([b"a"]) == [None] and store.exists([b"a"]) == [False] and store.set([(b"b", b"2")]) == [False]
        assert store.health().num_errors >= 1


def test_an_unreachable_store_is_misses_and_its_seed_breaker_opens(redis_single):
    """Nothing listening at the endpoint: misses at once, never an exception; after breaker_failures calls
    the topology breaker is open and further calls add no errors (they do not try)."""
    config = RemoteConfig((("127.0.0.1", dead_port()),), timeout_s=TIMEOUT_S, breaker_failures=3,
                          breaker_open_s=60)
    store = RedisStore(config)
    try:
        for i in range(3):
            assert bounded(lambda: store.get([b"a", b"b"])) == [None, None]
            assert store.health().num_errors == i + 1
        health = store.health()
        assert (health.mode, health.state, health.num_opened) == ("unknown", "open", 1)
        assert bounded(lambda: store.set([(b"a", b"1")])) == [False]
        assert bounded(lambda: store.exists([b"a"])) == [False]
        assert store.health().num_errors == 3
    finally:
        store.close()


def test_moved_slots_are_a_miss_then_the_slot_table_is_read_again(redis_cluster):
    """A slot moved to another master after the store read the table: the first get of a key in it is a
    miss (MOVED, counted), the next one finds it on its new owner."""
    cluster = redis_cluster
    old, new = cluster.ports[0], cluster.ports[1]
    key = keys_owned_by(cluster, old, 1, prefix="moved")[0]
    with open_store(cluster) as store:
        assert store.get([key]) == [None]  # the slot table is read
        ids = {}
        for port in cluster.ports:
            with contextlib.closing(cluster.node_client(port)) as node:
                ids[port] = node.execute_command("CLUSTER MYID")
        with contextlib.closing(cluster.node_client(new)) as node:
            node.execute_command("CLUSTER BUMPEPOCH")
        for port in (new, old, *cluster.ports[2:]):  # the new owner first, as redis-cli --cluster does
            with contextlib.closing(cluster.node_client(port)) as node:
                node.execute_command("CLUSTER SETSLOT", key_slot(key), "NODE", ids[new])
        wait_until(lambda: owner_port(cluster, key) == new, timeout_s=10, what="the slot to move")
        with contextlib.closing(cluster.node_client(new)) as node:
            node.set(key, b"moved here")
        errors = store.health().num_errors
        assert store.get([key]) == [None]  # the old owner answers MOVED
        assert store.health().num_errors == errors + 1
        assert store.get([key]) == [b"moved here"]
        assert store.health().state is BreakerState.CLOSED  # MOVED is not a node failure


# ------------------------------------------------------------------------------------------------ failures


def test_a_killed_master_gives_misses_only_for_its_keys_and_its_breaker_opens(redis_cluster):
    """SIGKILL one master: its keys are misses, every other key exact, at once; after breaker_failures
    calls its breaker (and only its) is open, and later calls no longer try it."""
    cluster = redis_cluster
    owned = keys_per_node(cluster, 10, "kill")
    keys = [key for port in cluster.ports for key in owned[port]]
    victim = cluster.ports[2]
    with open_store(cluster, breaker_failures=3, breaker_open_s=60) as store:
        assert store.set([(key, value_of(key)) for key in keys]) == [True] * len(keys)
        kill_node(cluster, victim)
        expected = [None if key in owned[victim] else value_of(key) for key in keys]
        for call in range(1, 4):
            assert bounded(lambda: store.get(keys)) == expected
            health = store.health()
            assert health.num_errors == call
            # unreachable from its first failed call; the breaker opens at the third
            assert (health.state, health.num_open_nodes) == ("open" if call == 3 else "closed", 1)
        assert bounded(lambda: store.get(keys)) == expected
        assert bounded(lambda: store.exists(keys)) == [key not in owned[victim] for key in keys]
        assert bounded(lambda: store.set([(key, b"new") for key in keys])) == [key not in owned[victim] for key in keys]
        health = store.health()
        assert (health.num_errors, health.num_opened, health.num_nodes) == (3, 1, 3)


def test_a_stopped_master_costs_a_bounded_wait_then_nothing(redis_cluster):
    """One master frozen (SIGSTOP: it accepts and never answers): a get over all nodes returns within
    10 timeouts with misses for its keys and exact values for the rest; after breaker_failures such calls
    its breaker is open, and the next calls return without touching it (no new errors)."""
    cluster = redis_cluster
    owned = keys_per_node(cluster, 10, "stop")
    keys = [key for port in cluster.ports for key in owned[port]]
    victim = cluster.ports[0]
    expected = [None if key in owned[victim] else value_of(key) for key in keys]
    with open_store(cluster, breaker_failures=2, breaker_open_s=60) as store:
        assert store.set([(key, value_of(key)) for key in keys]) == [True] * len(keys)
        with stopped(cluster, victim):
            assert bounded(lambda: store.get(keys)) == expected
            assert store.health().state is BreakerState.CLOSED and store.health().num_errors == 1
            assert bounded(lambda: store.exists(keys)) == [key not in owned[victim] for key in keys]
            health = store.health()
            assert (health.state, health.num_open_nodes, health.num_errors) == ("open", 1, 2)
            for _ in range(5):
                assert bounded(lambda: store.get(keys), limit_s=TIMEOUT_S * 4) == expected
            assert bounded(lambda: store.set([(key, b"x") for key in owned[victim]])) == [False] * 10
            assert store.health().num_errors == 2


def test_a_stopped_masters_breaker_probes_after_open_s_and_closes_once_it_answers(redis_cluster):
    """breaker_open_s 0.5: half-open after it; a probe while the node is still frozen fails and re-opens the
    breaker; once the node is resumed the next probe succeeds, the breaker closes and its keys are hits."""
    cluster = redis_cluster
    owned = keys_per_node(cluster, 5, "probe")
    keys = [key for port in cluster.ports for key in owned[port]]
    victim = cluster.ports[1]
    with open_store(cluster, breaker_failures=1, breaker_open_s=0.5) as store:
        assert store.set([(key, value_of(key)) for key in keys]) == [True] * len(keys)
        with stopped(cluster, victim):
            bounded(lambda: store.get(keys))
            assert store.health().num_open_nodes == 1
            wait_until(lambda: store.health().state is BreakerState.HALF_OPEN, timeout_s=10,
                       what="the breaker to go half-open", interval_s=0.01)
            half_open = store.health()  # a breaker that may probe is not a node that answers
            assert half_open.num_open_nodes == 1 and not half_open.serving
            bounded(lambda: store.get(keys))  # the probe: still frozen
            health = store.health()
            assert (health.num_open_nodes, health.num_opened, health.num_errors) == (1, 2, 2)
        wait_until(lambda: store.health().state is BreakerState.HALF_OPEN, timeout_s=10,
                   what="the breaker to go half-open again", interval_s=0.01)
        assert bounded(lambda: store.get(keys)) == [value_of(key) for key in keys]
        health = store.health()
        assert (health.state, health.num_open_nodes, health.num_errors) == ("closed", 0, 2)


# ------------------------------------------------------------------------------------------------ probes


def test_a_probe_knows_a_healthy_store_before_any_request(redis_cluster_module):
    with open_store(redis_cluster_module) as store:
        assert store.health().mode == "unknown" and not store.health().serving  # nothing asked yet
        health = bounded(store.probe)
        assert (health.mode, health.num_nodes, health.num_open_nodes, health.serving) == ("cluster", 3, 0, True)
        assert (health.num_errors, health.last_error) == (0, "")


def test_a_probe_counts_every_stopped_master_and_sees_them_answer_again(redis_cluster):
    """All three masters frozen: one probe finds 3 of 3 unreachable, though no request went to any of
    them and no breaker opened yet; resumed, the next probe finds the store serving."""
    with open_store(redis_cluster) as store:
        assert bounded(store.probe).serving
        with contextlib.ExitStack() as frozen:
            for port in redis_cluster.ports:
                frozen.enter_context(stopped(redis_cluster, port))
            health = bounded(store.probe)
            assert (health.num_nodes, health.num_open_nodes, health.serving) == (3, 3, False)
            assert health.state is BreakerState.CLOSED and f"{redis_cluster.host}:" in health.last_error
        health = bounded(store.probe)
        assert (health.num_open_nodes, health.serving, health.last_error) == (0, True, "")


def test_probing_on_its_thread_sees_a_node_die_with_no_traffic(redis_cluster):
    with open_store(redis_cluster, probe_interval_s=0.1) as store:
        store.start_probing(store.config.probe_interval_s)
        assert store.health().serving  # probed before start_probing returned
        kill_node(redis_cluster, redis_cluster.ports[2])
        wait_until(lambda: store.health().num_open_nodes == 1, timeout_s=10, what="the probe to find the dead node",
                   interval_s=0.02)
        assert not store.health().serving


def test_keys_on_a_node_known_dead_end_the_reachable_run_and_only_a_call_makes_it_known(redis_cluster):
    """num_reachable asks no node: right after a master is killed every key still counts (not known
    yet); once a probe found it dead, a run of keys ends before its first key on that master."""
    cluster = redis_cluster
    owned = keys_per_node(cluster, 3, "reach")
    victim, live = cluster.ports[1], cluster.ports[0]
    run = [owned[live][0], owned[cluster.ports[2]][0], owned[victim][0], owned[live][1]]
    with open_store(cluster) as store:
        assert bounded(store.probe).serving
        assert store.all_reachable() and store.num_reachable(run) == 4
        kill_node(cluster, victim)
        assert store.all_reachable() and store.num_reachable(run) == 4  # nothing asked it since
        assert bounded(store.probe).num_open_nodes == 1
        assert not store.all_reachable()
        assert (store.num_reachable(run), store.num_reachable(run[:2]), store.num_reachable(owned[victim])) == (2, 2, 0)


# ------------------------------------------------------------------------------------------------ credentials, TLS


def test_an_acl_user_with_the_right_password_reads_and_writes(make_redis_cluster):
    cluster = make_redis_cluster(username="kvtier", password="t3-secret")
    keys = [b"kvtierd:acl:%d" % i for i in range(30)]
    with open_store(cluster) as store:
        assert store.set([(key, value_of(key)) for key in keys]) == [True] * len(keys)
        assert store.get(keys) == [value_of(key) for key in keys]
        assert store.health().num_errors == 0


@pytest.mark.parametrize("credentials", [
    pytest.param(dict(password=WRONG_PASSWORD), id="wrong-password"),
    pytest.param(dict(username="", password=""), id="anonymous"),
    pytest.param(dict(username="", password="t3-secret"), id="default-user"),
])
def test_wrong_credentials_are_misses_and_errors_never_an_exception_nor_a_logged_password(
        make_redis_cluster, caplog, credentials):
    """The store refuses us: get/exists/set answer misses, errors are counted, the topology breaker opens,
    nothing raises, and neither password appears in the log."""
    cluster = make_redis_cluster(username="kvtier", password="t3-secret")
    with contextlib.closing(cluster.cluster_client()) as client:
        client.set(b"kvtierd:acl:x", b"1")
    caplog.set_level(logging.DEBUG)
    with open_store(cluster, breaker_failures=2, breaker_open_s=60, **credentials) as store:
        assert bounded(lambda: store.get([b"kvtierd:acl:x"])) == [None]
        assert bounded(lambda: store.exists([b"kvtierd:acl:x"])) == [False]
        assert bounded(lambda: store.set([(b"kvtierd:acl:y", b"2")])) == [False]
        health = store.health()
        assert health.num_errors == 2 and health.state is BreakerState.OPEN
        assert health.credentials_refused and "credentials refused" in health.last_error, health
        assert "t3-secret" not in health.last_error and WRONG_PASSWORD not in health.last_error
    with contextlib.closing(cluster.cluster_client()) as client:
        assert client.get(b"kvtierd:acl:y") is None
    assert "T3 store unreachable" in caplog.text  # logged, without a password
    assert "t3-secret" not in caplog.text and WRONG_PASSWORD not in caplog.text


def test_a_password_file_from_the_daemon_config_authenticates(make_redis_cluster, tmp_path):
    """[remote] password_file (a mounted Secret: trailing newline) becomes the store's password: it works."""
    cluster = make_redis_cluster(username="kvtier", password="t3-secret")
    (tmp_path / "password").write_text("t3-secret\n")
    config = RemoteConfig(endpoints=cluster.seeds, username="kvtier", password_file=str(tmp_path / "password"),
                          timeout_s=TIMEOUT_S).with_password_read()
    store = RedisStore(config)
    try:
        assert store.set([(b"kvtierd:file", b"1")]) == [True] and store.get([b"kvtierd:file"]) == [b"1"]
        assert store.health().num_errors == 0
    finally:
        store.close()


def test_a_user_without_permission_gets_misses_and_its_nodes_breakers_open(redis_cluster):
    """NOPERM replies (an ACL user that may SET but not GET): misses, counted, the nodes' breakers open; no
    exception."""
    cluster = redis_cluster
    for port in cluster.ports:  # ACLs are per node
        with contextlib.closing(cluster.node_client(port)) as node:
            node.execute_command("ACL", "SETUSER", "writer", "on", ">w-pw", "~*", "&*", "+@all", "-get")
    keys = [b"kvtierd:noperm:%d" % i for i in range(30)]
    with open_store(cluster, username="writer", password="w-pw", breaker_failures=2, breaker_open_s=60) as store:
        assert store.set([(key, b"1") for key in keys]) == [True] * len(keys)
        for _ in range(2):
            assert bounded(lambda: store.get(keys)) == [None] * len(keys)
        health = store.health()
        assert (health.state, health.num_open_nodes) == ("open", 3) and health.num_errors >= 2
        assert bounded(lambda: store.exists(keys)) == [False] * len(keys)  # open: not even asked


def test_a_tls_cluster_works_with_its_ca_and_mutual_tls(make_redis_cluster, tmp_path):
    """TLS with the cluster's CA (and, mutual, with a client certificate): exact reads and writes."""
    cluster = make_redis_cluster(password="pw", tls_dir=tmp_path / "tls")
    keys = [b"kvtierd:tls:%d" % i for i in range(30)]
    with open_store(cluster) as store:
        assert store.set([(key, value_of(key)) for key in keys]) == [True] * len(keys)
        assert store.get(keys) == [value_of(key) for key in keys]
    with open_store(cluster, tls_cert_file=str(cluster.tls.cert), tls_key_file=str(cluster.tls.key)) as store:
        assert store.get(keys) == [value_of(key) for key in keys]
        assert store.health().num_errors == 0


@pytest.mark.parametrize("fields", [
    pytest.param(dict(tls=False, tls_ca_file=""), id="plain-to-tls"),
    pytest.param(dict(tls_ca_file=""), id="untrusted-ca"),
])
def test_a_tls_cluster_without_tls_or_its_ca_is_misses_never_an_exception(make_redis_cluster, tmp_path, fields):
    cluster = make_redis_cluster(password="pw", tls_dir=tmp_path / "tls")
    with contextlib.closing(cluster.cluster_client()) as client:
        client.set(b"kvtierd:tls:x", b"1")
    with open_store(cluster, **fields) as store:
        assert bounded(lambda: store.get([b"kvtierd:tls:x"])) == [None]
        assert bounded(lambda: store.set([(b"kvtierd:tls:y", b"1")])) == [False]
        assert store.health().num_errors >= 1
