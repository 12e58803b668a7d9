"""A node's figures add up over its pools: a real daemon with two layouts (two pools on one
device, so one shared copy engine), traffic that moves bytes in one pool only; every
`kvtierd_*_total` family summed over models is what the node did, and the idle pool shows 0."""

from __future__ import annotations

import collections
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.client import KvtierClient
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from kvtierd.layout import Layout
from tests.server.e2e_runner import expected_block, prompt

pytestmark = pytest.mark.timeout(180)
BUSY = Layout("sums-busy", 2, 2, 16, 4)  # 1 KiB a block
IDLE = Layout("sums-idle", 2, 1, 16, 4)  # 512 B a block
T0_BLOCKS = 64  # of BUSY: --t0-bytes 64KiB
FIRST_BLOCKS, SECOND_BLOCKS = 48, T0_BLOCKS  # the second Put evicts every block of the first from T0


def scrape(daemon: DaemonProcess) -> dict[str, dict[tuple, float]]:
    """`kvtierd_*_total` samples carrying a model label: name → {labels without model + (model,): value}."""
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    found: dict[str, dict[tuple, float]] = collections.defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvtierd_") and sample.name.endswith("_total") and "model" in sample.labels:
                rest = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model"))
                found[sample.name][rest + (("model", sample.labels["model"]),)] = sample.value
    return found


def summed(samples: dict[tuple, float]) -> dict[tuple, float]:
    """A family's samples summed over models, by their other labels."""
    total: dict[tuple, float] = collections.defaultdict(float)
    for labels, value in samples.items():
        total[labels[:-1]] += value
    return dict(total)


def of_model(samples: dict[tuple, float], model: str) -> dict[tuple, float]:
    return {labels[:-1]: value for labels, value in samples.items() if labels[-1] == ("model", model)}


def offloaded(daemon: DaemonProcess) -> float:
    return scrape(daemon)["kvtierd_offloaded_blocks_total"].get((("edge", "t0_t1"), ("model", BUSY.model_id)), 0)


def put(client: KvtierClient, seed: int, num_blocks: int) -> tuple[list[int], list[bytes]]:
    tokens = prompt(seed, num_blocks * BUSY.block_size)
    hashes = client.attach(BUSY).namespace.hash_blocks(tokens)
    blocks = [(h, tokens[4 * i:4 * i + 4], expected_block(h, BUSY.bytes_per_block)) for i, h in enumerate(hashes)]
    assert client.put(BUSY, blocks).num_blocks == num_blocks
    return tokens, hashes


@pytest.fixture
def daemon(tmp_path):
    """T0 → T1 written through (each committed block copied down once), nothing to T2."""
    args = small_daemon_args(str(tmp_path), t0_bytes="64KiB", extra=[
        "--set", "policy.t0_to_t1=write_through", "--set", "policy.t1_to_t2=off"])
    with DaemonProcess(args) as process:
        yield process


def test_transfer_bytes_and_every_total_add_up_over_pools(daemon):
    """Two Puts (48 + 64 blocks) written through d2h, the first read back from T1 (48 blocks h2d),
    all in one pool; the other pool only asks. Summed over models, the transfer bytes are the
    bytes of the blocks moved, and every `_total` of the idle pool is 0 (but its query tokens)."""
    bytes_per_block = BUSY.bytes_per_block
    with KvtierClient(daemon.address) as client:
        idle = client.attach(IDLE)
        absent = idle.namespace.hash_blocks(prompt(9, 4 * IDLE.block_size))
        assert idle.lookup(absent, num_query_blocks=len(absent)).total.num_blocks == 0
        assert client.get(IDLE, absent) == []
        first_tokens, first = put(client, 1, FIRST_BLOCKS)
        assert wait_until(lambda: offloaded(daemon) == FIRST_BLOCKS, timeout_s=20)  # its T0 blocks held till then
        put(client, 2, SECOND_BLOCKS)
        assert wait_until(lambda: offloaded(daemon) == FIRST_BLOCKS + SECOND_BLOCKS, timeout_s=20)
        got = client.get(BUSY, first, token_ids=first_tokens)
        assert got == [(h, expected_block(h, bytes_per_block)) for h in first]
        pools = {p.layout.model_id: p for p in client.stats().pools}

    moved = {"d2h": (FIRST_BLOCKS + SECOND_BLOCKS) * bytes_per_block, "h2d": FIRST_BLOCKS * bytes_per_block, "h2h": 0}
    families = scrape(daemon)
    transfer = families["kvtierd_transfer_bytes_total"]
    assert summed(transfer) == {(("direction", d),): nbytes for d, nbytes in moved.items()}
    assert of_model(transfer, IDLE.model_id) == {(("direction", d),): 0 for d in moved}
    for model, pool in pools.items():  # the Stats RPC (kvtierctl stats' "moved") says the same, pool by pool
        assert {t.direction: t.bytes_moved for t in pool.transfers} == \
            {d: of_model(transfer, model)[(("direction", d),)] for d in moved}

    expected_sums = {
        "kvtierd_offloaded_blocks_total": {(("edge", "t0_t1"),): FIRST_BLOCKS + SECOND_BLOCKS},
        "kvtierd_prefix_hit_blocks_total": {(("tier", "t1"),): FIRST_BLOCKS, (("tier", "t0"),): 0},
        "kvtierd_evictions_total": {(("tier", "t0"),): FIRST_BLOCKS + FIRST_BLOCKS},  # by the 2nd Put, by the Get
        "kvtierd_failed_loads_total": {(): 0},
        "kvtierd_failed_offloads_total": {(): 0},
        "kvtierd_prefix_query_tokens_total": {(): (len(absent) * 2) * IDLE.block_size
                                              + (FIRST_BLOCKS * 2 + SECOND_BLOCKS) * BUSY.block_size},
    }
    for name, want in expected_sums.items():
        total = summed(families[name])
        assert {labels: total[labels] for labels in want} == want, name
    for name, samples in families.items():
        idle_samples = of_model(samples, IDLE.model_id)
        if name == "kvtierd_prefix_query_tokens_total":  # its Lookup and its Get asked
            assert idle_samples == {(): len(absent) * 2 * IDLE.block_size}
        elif name == "kvtierd_lookup_tokens_total":  # the same tokens, all misses
            assert idle_samples == {(("tier", tier),): 0 for tier in ("t0", "t1", "t2", "t3")} | \
                {(("tier", "miss"),): len(absent) * 2 * IDLE.block_size}
        else:
            assert set(idle_samples.values()) == {0}, (name, idle_samples)
