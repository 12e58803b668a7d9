"""Two real vLLM engines on two daemons ("nodes") sharing a prefix through a real Redis Cluster:
what engine A computed on node A, engine B on node B loads from the shared store (T3) and
decodes to exactly the tokens of an engine without a connector."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import wait_until
from tests.connectors.vllm.test_vllm_engines import (  # noqa: F401 (fixtures)
    SHARED_PREFIX_LEN,
    SHARED_PROMPTS,
    assert_hits_the_prefix,
    engines,
    expected,
    reference,
    start_daemon,
    the_pool,
    tier,
    tiny_llama,
)
from tests.t3.conftest import make_redis_cluster, redis_cluster  # noqa: F401 (fixtures)


@pytest.fixture
def two_short_dirs():
    directories = [tempfile.mkdtemp(prefix=f"kvv{name}-") for name in "ab"]
    yield directories
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.timeout(900)
def test_engine_b_on_node_b_loads_the_prefix_engine_a_stored_through_the_cluster(
        reference, engines, redis_cluster, two_short_dirs):  # noqa: F811
    """Node B's tiers are empty when engine B starts: every cached token it gets comes from T3."""
    remote = ["--set", f"remote.endpoints={redis_cluster.seeds}", "--set", "policy.t0_to_t1=write_through"]
    with start_daemon(two_short_dirs[0], remote) as node_a, start_daemon(two_short_dirs[1], remote) as node_b, \
            KvtierClient(node_a.address) as on_a, KvtierClient(node_b.address) as on_b:
        cold = engines("cold", SHARED_PROMPTS, node_a.address).result()
        assert cold["output_token_ids"] == expected(reference, SHARED_PROMPTS)
        num_prefix_blocks = SHARED_PREFIX_LEN // 32
        assert wait_until(lambda: the_pool(on_a).t3.num_written_blocks >= num_prefix_blocks, timeout_s=60), \
            the_pool(on_a)
        warm = engines("warm", SHARED_PROMPTS, node_b.address).result()
        pool_b = the_pool(on_b)
    assert_hits_the_prefix(warm, SHARED_PROMPTS)
    assert warm["output_token_ids"] == expected(reference, SHARED_PROMPTS)
    assert pool_b.t3.num_hit_blocks >= num_prefix_blocks, pool_b
    assert tier(pool_b, "t2").num_hit_blocks == 0, pool_b
