"""The T3 tier's fixtures: a real Redis Cluster (3 masters) and one plain redis-server (tests/t3/redis_cluster.py).

`redis_cluster`: a fresh cluster per test (~2.5 s to start here), free to kill nodes in;
`redis_cluster_module`: one cluster for a module's tests that kill nothing (flush what you write);
`make_redis_cluster(**options)`: a fresh cluster with options (username, password, tls_dir, masters,
maxmemory, node_timeout_ms), any number per test; `redis_single`: a plain redis-server per test.
Every server is stopped at teardown. No redis-server (scripts/install-redis-server failed) fails
the test with the reason; it never skips.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.t3.redis_cluster import running_cluster, running_single


@pytest.fixture
def make_redis_cluster(tmp_path):
    with contextlib.ExitStack() as stack:
        count = 0

        def make(**options):
            nonlocal count
            count += 1
            return stack.enter_context(running_cluster(tmp_path / f"redis-cluster-{count}", **options))

        yield make


@pytest.fixture
def redis_cluster(make_redis_cluster):
    return make_redis_cluster()


@pytest.fixture(scope="module")
def redis_cluster_module(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture
def redis_single(tmp_path):
    with running_single(tmp_path / "redis-single") as server:
        yield server
