"""SGLang's storage calls (interface v1) on a kvtierd daemon: pages between SGLang's host pool and the
daemon's mapped pool.

SGLang (sglang 0.5.23, managers/cache_controller.py) calls its storage tier in batches of at most 128
pages, each page named by a chained SHA-256 string of its tokens and every token before it; the
keys of earlier batches of the same sequence come as `prefix_keys`. It never tells the tokens. So:

- Keys: each SGLang key becomes a block hash of the session's namespace (`Namespace.foreign_keys`,
  scheme "sglang"): bound to the layout (model, page geometry, dtype, TP/PP rank: page_layout.py) and
  to the caller's tenant (the daemon adds it), never equal to a kvtierd chain hash.
- Chains: the pages of one call are a chain (each page's parent the one before it); its first page's
  parent is the key before it where SGLang says it (`prefix_keys`, with the extra config's
  `hicache_storage_pass_prefix_keys`), else the root. SGLang stores radix node by radix node and loads
  from wherever its own cache ends, so a load may cross a node boundary whose parent was not known:
  the daemon checks no parent of an Acquire's first block, so the load goes on with an Acquire from
  that page (one more RPC per such boundary; none when SGLang passes prefix_keys).
- `count_leading` (batch_exists): one Lookup, each page a chain of its own (no parent checked: the
  SGLang key already names every token before it), prefetching the lower-tier part towards T1.
- `store` (batch_set_v1): Acquire for store (pages the daemon holds come first and are not copied),
  copy the other pages into the fresh pool blocks, Commit them with no tokens and release: 2 RPCs.
- `load` (batch_get_v1): Acquire every hit, Wait for the lower tiers' loads, copy the ready blocks
  into the pages, Release (per segment, above). Pages after the first that is not ready are misses.

A daemon that is down, restarting or failing costs SGLang misses, never an exception or a hang: every
call is bounded by the link's timeout, and a failed call is a miss (False / 0), logged once per 100.
No SGLang import here: hicache_storage.py adapts SGLang's class to this one.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence

import torch

from kvtierd.block_hash import BlockHash
from kvtierd.client import Session
from kvtierd.connectors.daemon_link import DaemonLink
from kvtierd.connectors.sglang.host_pages import HostPages
from kvtierd.errors import KvtierError
from kvtierd.token_bytes import NO_TOKENS

log = logging.getLogger(__name__)

KEY_SCHEME = "sglang"


class PageStoreStats:
    """What the store did, in pages and calls (thread-safe counters)."""

    FIELDS: tuple[str, ...] = ("lookups", "hit_pages", "stored_pages", "already_stored_pages", "loaded_pages",
                               "missed_pages", "failed_calls")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = dict.fromkeys(self.FIELDS, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                self.counts[name] += value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class DaemonPageStore:
    """The pages of one SGLang host pool in one daemon layout.

    Invariants: `pages.block_shape` is the layout's block in bytes (`pages.page_nbytes ==
    layout.bytes_per_block`); a page is copied into a pool block only between that block's Acquire
    and its Commit, and out of one only between its Acquire (and Wait) and Release.
    """

    def __init__(self, link: DaemonLink, pages: HostPages) -> None:
        assert link.map_pool, "the page store copies through the daemon's mapped pool"
        if pages.page_nbytes != link.layout.bytes_per_block:
            raise ValueError(f"a host page is {pages.page_nbytes} bytes, a block of {link.layout} "
                             f"{link.layout.bytes_per_block}")
        self.link = link
        self.pages = pages
        self.stats = PageStoreStats()
        self._request_ids = itertools.count()
        self._num_failures = 0

    def count_leading(self, keys: Sequence[str]) -> int:
        """How many leading pages of `keys` the daemon holds in any tier (one Lookup)."""
        if not keys:
            return 0
        session = self.link.session()
        if session is None:
            return 0
        try:
            response = session.lookup(self._hashes(session, keys), prefetch=True, chain_lengths=[1] * len(keys))
        except KvtierError as error:
            self._failed(session, error, "lookup")
            return 0
        held = [chain.num_hit_blocks for chain in response.chains]
        num_hits = held.index(0) if 0 in held else len(held)
        self.stats.add(lookups=1, hit_pages=num_hits)
        return num_hits

    def store(self, keys: Sequence[str], host_indices: torch.Tensor, parent_key: str | None) -> list[bool]:
        """Store the pages; per key, whether the daemon holds it afterwards."""
        if not keys:
            return []
        session = self.link.session()
        if session is None:
            return [False] * len(keys)
        request_id = f"sglang-store-{next(self._request_ids)}"
        held = False
        try:
            hashes = self._hashes(session, keys)
            parent = self._parent(session, parent_key)
            acquired = session.acquire(request_id, hashes, 0, for_store=True, parent_hash=parent)
            held = True
            num_hits = acquired.num_t0_hit_blocks + acquired.num_loading_blocks
            fresh_ids = acquired.block_ids[num_hits:len(keys)]
            if fresh_ids:
                page_ids = self.pages.page_ids(host_indices)[num_hits:len(keys)]
                self._to_pool(session, page_ids, fresh_ids)
                committed = session.commit_and_release(request_id, fresh_ids, hashes[num_hits:], NO_TOKENS,
                                                       hashes[num_hits - 1] if num_hits else parent)
                held = not committed.released
            self.stats.add(stored_pages=len(fresh_ids), already_stored_pages=num_hits)
            return [True] * len(keys)
        except (KvtierError, ValueError, RuntimeError) as error:
            self._failed(session, error, "store")
            return [False] * len(keys)
        finally:
            if held:
                self._release(session, request_id)

    def load(self, keys: Sequence[str], host_indices: torch.Tensor, parent_key: str | None) -> list[bool]:
        """Load the leading pages the daemon holds into the host pages; per key, whether it was loaded.
        (`parent_key` is not needed: the daemon checks no parent of an Acquire's first block.)"""
        if not keys:
            return []
        session = self.link.session()
        if session is None:
            return [False] * len(keys)
        num_loaded = 0
        try:
            hashes, page_ids = self._hashes(session, keys), self.pages.page_ids(host_indices)
            while num_loaded < len(keys):
                num_ready = self._load_segment(session, hashes[num_loaded:], page_ids[num_loaded:])
                if num_ready == 0:
                    break
                num_loaded += num_ready
        except (KvtierError, ValueError, RuntimeError) as error:
            self._failed(session, error, "load")
            num_loaded = 0
        self.stats.add(loaded_pages=num_loaded, missed_pages=len(keys) - num_loaded)
        return [True] * num_loaded + [False] * (len(keys) - num_loaded)

    def _load_segment(self, session: Session, hashes: list[BlockHash], page_ids: list[int]) -> int:
        """Load the leading pages of one chain that the daemon holds (Acquire, Wait, copy, Release);
        how many were loaded."""
        request_id = f"sglang-load-{next(self._request_ids)}"
        acquired = session.acquire(request_id, hashes, 0, load_every_hit=True)
        try:
            num_ready = min(acquired.num_t0_hit_blocks + acquired.num_loading_blocks, len(hashes))
            if acquired.pending:
                num_ready = min(session.wait(request_id), num_ready)
            if num_ready:
                self._from_pool(session, acquired.block_ids[:num_ready], page_ids[:num_ready])
            return num_ready
        finally:
            self._release(session, request_id)

    def _hashes(self, session: Session, keys: Sequence[str]) -> list[BlockHash]:
        return session.namespace.foreign_keys(KEY_SCHEME, keys)

    def _parent(self, session: Session, parent_key: str | None) -> bytes | None:
        """The hash before a batch's first page: the previous batch's last key, or None (the root)."""
        return None if parent_key is None else self._hashes(session, [parent_key])[0]

    def _to_pool(self, session: Session, page_ids: list[int], block_ids: list[int]) -> None:
        pool = _pool_bytes(session)
        self.pages.copy_out(page_ids, [pool[block_id] for block_id in block_ids])
        if pool.device.type == "cuda":
            torch.cuda.current_stream(pool.device).synchronize()  # the bytes are in the pool before Commit

    def _from_pool(self, session: Session, block_ids: list[int], page_ids: list[int]) -> None:
        pool = _pool_bytes(session)
        self.pages.copy_in(page_ids, [pool[block_id] for block_id in block_ids])

    def _release(self, session: Session, request_id: str) -> None:
        try:
            session.release(request_id)
        except KvtierError as error:  # the daemon reclaims a lost session's blocks itself
            self._failed(session, error, "release")

    def _failed(self, session: Session, error: BaseException, call: str) -> None:
        if isinstance(error, KvtierError):
            self.link.failed(session, error)
        self.stats.add(failed_calls=1)
        self._num_failures += 1
        if self._num_failures == 1 or self._num_failures % 100 == 0:
            log.warning("kvtierd SGLang storage: a %s failed (%s: %s); a miss for SGLang; %d failed so far",
                        call, type(error).__name__, error, self._num_failures)


def _pool_bytes(session: Session) -> torch.Tensor:
    """The session's mapped pool as one row of bytes per block."""
    assert session.pool is not None, "the page store's link maps the pool"
    tensor = session.pool.tensor
    return tensor.view(tensor.shape[0], -1).view(torch.uint8)
