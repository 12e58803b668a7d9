"""SGLang's storage calls on a real `kvtierd serve`: host pages in, host pages out, across engines,
host layouts, tenants, restarts and a daemon that is gone (no SGLang needed: the page store is the
whole data path; hicache_storage.py only adapts SGLang's class to it)."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from kvtierd.client import KvtierClient
from kvtierd.connectors.daemon_link import DaemonLink
from kvtierd.connectors.sglang.host_pages import HostPages
from kvtierd.connectors.sglang.page_layout import EngineShard, page_layout
from kvtierd.connectors.sglang.page_store import KEY_SCHEME, DaemonPageStore
from kvtierd.launch.daemon_process import WRITE_THROUGH, DaemonProcess, small_daemon_args, wait_until

LAYERS, HEADS, DIM, PAGE, NUM_PAGES = 2, 2, 16, 4, 12
SHARD = EngineShard("tiny-llama")
# Through the daemon's pool mapped into the process, and as bytes in Put and Get (no mapping).
TRANSPORTS = pytest.mark.parametrize("map_pool", [True, False], ids=["mapped", "put-get"])


def host_buffer(host_layout: str) -> torch.Tensor:
    shape = {"layer_first": (2, LAYERS, PAGE * NUM_PAGES, HEADS, DIM),
             "page_first": (2, PAGE * NUM_PAGES, LAYERS, HEADS, DIM)}[host_layout]
    return torch.zeros(shape, dtype=torch.float16)


def engine(address: str, host_layout: str = "layer_first", token: str | None = None,
           timeout_s: float = 5.0, map_pool: bool = True) -> tuple[DaemonPageStore, HostPages]:
    """One SGLang process's storage: its host pool and its page store (through the mapped pool, or Put
    and Get without it)."""
    pages = HostPages.of_buffer(host_buffer(host_layout), "mha", host_layout, PAGE)
    layout = page_layout(SHARD, pages.block_shape, "float16")
    link = DaemonLink(layout, target=address, token=token, map_pool=map_pool, timeout_s=timeout_s,
                      retry_after_s=0)
    return DaemonPageStore(link, pages), pages


def sglang_keys(seed: int, num_pages: int) -> list[str]:
    """Chained SHA-256 strings, as SGLang names pages (each key covers every token before it)."""
    keys, prior = [], b""
    for page in range(num_pages):
        prior = hashlib.sha256(prior + f"{seed}:{page}".encode()).digest()
        keys.append(prior.hex())
    return keys


def indices(page_ids: list[int]) -> torch.Tensor:
    """SGLang's host token indices of these pages."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in page_ids])


def fill(pages: HostPages, page_ids: list[int], seed: int) -> torch.Tensor:
    blocks = torch.randn(len(page_ids), *pages.block_shape, generator=torch.Generator().manual_seed(seed)).half()
    pages.write(page_ids, blocks)
    return blocks


@TRANSPORTS
def test_a_second_engine_loads_what_the_first_stored_whatever_its_host_layout(tmp_path, map_pool):
    keys = sglang_keys(1, 6)
    with DaemonProcess(small_daemon_args(str(tmp_path))) as daemon:
        first, first_pages = engine(daemon.address, "layer_first", map_pool=map_pool)
        stored = fill(first_pages, [5, 6, 7, 8, 9, 10], seed=1)
        assert first.store(keys[:3], indices([5, 6, 7]), None) == [True] * 3
        assert first.store(keys[3:], indices([8, 9, 10]), keys[2]) == [True] * 3

        second, second_pages = engine(daemon.address, "page_first", map_pool=map_pool)
        assert second.count_leading(keys) == 6
        assert second.count_leading(keys[2:]) == 4  # from the middle: a key names every token before it
        assert second.count_leading([*keys[:2], sglang_keys(9, 1)[0], keys[3]]) == 2
        assert second.load(keys, indices([0, 2, 4, 6, 8, 10]), None) == [True] * 6
        assert torch.equal(second_pages.read([0, 2, 4, 6, 8, 10]), stored)
        assert second.stats.snapshot()["loaded_pages"] == 6
        first.link.close()
        second.link.close()


@TRANSPORTS
def test_a_store_of_pages_the_daemon_holds_copies_only_the_new_ones(tmp_path, map_pool):
    keys = sglang_keys(2, 5)
    with DaemonProcess(small_daemon_args(str(tmp_path))) as daemon:
        store, pages = engine(daemon.address, map_pool=map_pool)
        fill(pages, list(range(5)), seed=2)
        store.store(keys[:3], indices([0, 1, 2]), None)
        assert store.store(keys, indices(list(range(5))), None) == [True] * 5
        counts = store.stats.snapshot()
        assert (counts["stored_pages"], counts["already_stored_pages"]) == (5, 3)
        store.link.close()


@TRANSPORTS
def test_a_load_crosses_store_boundaries_whose_parent_sglang_did_not_pass(tmp_path, map_pool):
    """SGLang stores radix node by radix node; without prefix keys a node's first page has no known parent.
    A load from the first page still gets every page, one Acquire per such boundary."""
    keys = sglang_keys(3, 6)
    with DaemonProcess(small_daemon_args(str(tmp_path))) as daemon:
        writer, writer_pages = engine(daemon.address, map_pool=map_pool)
        stored = fill(writer_pages, list(range(6)), seed=3)
        for start in (0, 2, 4):  # three nodes, none told its parent
            assert writer.store(keys[start:start + 2], indices([start, start + 1]), None) == [True, True]
        reader, reader_pages = engine(daemon.address, map_pool=map_pool)
        assert reader.load(keys, indices(list(range(6, 12))), None) == [True] * 6
        assert torch.equal(reader_pages.read(list(range(6, 12))), stored)
        assert reader.load([*keys[:2], sglang_keys(8, 1)[0], *keys[3:]], indices(list(range(6, 12))), None) == \
            [True, True, False, False, False, False]  # a missing page ends the hit
        writer.link.close()
        reader.link.close()


@TRANSPORTS
def test_two_tenants_never_see_each_others_pages(tmp_path, map_pool):
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("acme a-token\nglobex g-token\n")
    keys = sglang_keys(4, 3)
    with DaemonProcess(small_daemon_args(str(tmp_path), extra=["--tokens-file", str(tokens_file)])) as daemon:
        acme, acme_pages = engine(daemon.address, token="a-token", map_pool=map_pool)
        fill(acme_pages, [0, 1, 2], seed=4)
        assert acme.store(keys, indices([0, 1, 2]), None) == [True] * 3
        globex, globex_pages = engine(daemon.address, token="g-token", map_pool=map_pool)
        assert globex.count_leading(keys) == 0
        assert globex.load(keys, indices([0, 1, 2]), None) == [False] * 3
        assert globex_pages.view.count_nonzero() == 0  # not a byte of acme's
        assert acme.count_leading(keys) == 3
        acme.link.close()
        globex.link.close()


@TRANSPORTS
def test_pages_stored_before_a_restart_load_from_t2_after_it(tmp_path, map_pool):
    keys = sglang_keys(5, 4)
    args = small_daemon_args(str(tmp_path), extra=WRITE_THROUGH)
    with DaemonProcess(args) as daemon:
        store, pages = engine(daemon.address, map_pool=map_pool)
        stored = fill(pages, [0, 1, 2, 3], seed=5)
        assert store.store(keys, indices([0, 1, 2, 3]), None) == [True] * 4
        with KvtierClient(daemon.address) as client:
            assert wait_until(lambda: [t.num_cached_blocks for p in client.stats().pools for t in p.tiers
                                       if t.tier == "t2"] == [4])
        store.link.close()
    with DaemonProcess(args) as daemon:
        store, pages = engine(daemon.address, map_pool=map_pool)
        assert store.count_leading(keys) == 4
        assert store.load(keys, indices([4, 5, 6, 7]), None) == [True] * 4
        assert torch.equal(pages.read([4, 5, 6, 7]), stored)
        store.link.close()


def test_a_daemon_that_is_gone_costs_misses_never_an_error_or_a_hang(tmp_path):
    keys = sglang_keys(6, 3)
    daemon = DaemonProcess(small_daemon_args(str(tmp_path)))
    with daemon:
        store, pages = engine(daemon.address, timeout_s=2.0)
        fill(pages, [0, 1, 2], seed=6)
        assert store.store(keys, indices([0, 1, 2]), None) == [True] * 3
    started = time.monotonic()
    assert store.count_leading(keys) == 0
    assert store.load(keys, indices([3, 4, 5]), None) == [False] * 3
    assert store.store(keys, indices([0, 1, 2]), None) == [False] * 3
    assert time.monotonic() - started < 30  # bounded by the RPC timeouts, not a hang
    assert pages.read([3, 4, 5]).count_nonzero() == 0
    store.link.close()


def test_sglang_keys_are_foreign_keys_of_the_layout_and_never_kvtierd_chain_hashes(tmp_path):
    keys = sglang_keys(7, 2)
    with DaemonProcess(small_daemon_args(str(tmp_path))) as daemon:
        store, _ = engine(daemon.address)
        session = store.link.session()
        assert session is not None
        hashes = session.namespace.foreign_keys(KEY_SCHEME, keys)
        assert len(set(hashes)) == 2 and all(len(h) == 32 for h in hashes)
        other = page_layout(EngineShard("other-model"), store.pages.block_shape, "float16")
        with KvtierClient(daemon.address) as client:
            assert set(client.attach(other).namespace.foreign_keys(KEY_SCHEME, keys)).isdisjoint(hashes)
        store.link.close()
