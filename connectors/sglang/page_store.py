"""SGLang's storage calls (interface v1) on a kvtierd daemon: pages between SGLang's host pool and the
daemon.

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
- `store` (batch_set_v1) and `load` (batch_get_v1): through the mapped pool (2 RPCs a store, 2-3 a
  load) or Put / Get where the pool is not mapped (page_transports.py).

A daemon that is down, restarting or failing costs SGLang misses, never an exception or a hang: every
call is bounded by the link's timeout, and a failed call is a miss (False / 0), logged once per 100.
No SGLang import here: hicache_storage.py adapts SGLang's class to this one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from kvtierd.block_hash import BlockHash
from kvtierd.client import Session
from kvtierd.connectors.daemon_link import DaemonLink
from kvtierd.connectors.sglang.host_pages import HostPages
from kvtierd.connectors.sglang.page_transports import MappedPool, PageTransport, PutGet
from kvtierd.errors import KvtierError

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
    """The pages of one SGLang host pool in one daemon layout, moved by the link's transport (through the
    mapped pool, or Put and Get where the link maps none: page_transports.py).

    Invariant: `pages.page_nbytes == link.layout.bytes_per_block` (a page is one block).
    """

    def __init__(self, link: DaemonLink, pages: HostPages) -> None:
        if pages.page_nbytes != link.layout.bytes_per_block:
            raise ValueError(f"a host page is {pages.page_nbytes} bytes, a block of {link.layout} "
                             f"{link.layout.bytes_per_block}")
        self.link = link
        self.pages = pages
        self.transport: PageTransport = MappedPool(pages) if link.map_pool else PutGet(pages)
        self.stats = PageStoreStats()
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
        held = [hits.num_blocks for hits in response.hits]
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
        try:
            parent = None if parent_key is None else self._hashes(session, [parent_key])[0]
            written, held = self.transport.store(session, self._hashes(session, keys),
                                                 self.pages.page_ids(host_indices)[:len(keys)], parent)
        except (KvtierError, ValueError, RuntimeError) as error:
            self._failed(session, error, "store")
            return [False] * len(keys)
        self.stats.add(stored_pages=written, already_stored_pages=held)
        return [True] * len(keys)

    def load(self, keys: Sequence[str], host_indices: torch.Tensor, parent_key: str | None) -> list[bool]:
        """Load the leading pages the daemon holds into the host pages; per key, whether it was loaded.
        (`parent_key` is not needed: the daemon checks no parent of a chain's first block.) A load that
        stops at a page whose parent the store did not know (a radix node boundary without prefix keys)
        goes on from that page, one more call."""
        if not keys:
            return []
        session = self.link.session()
        if session is None:
            return [False] * len(keys)
        num_loaded = 0
        try:
            hashes, page_ids = self._hashes(session, keys), self.pages.page_ids(host_indices)
            while num_loaded < len(keys):
                num_ready = self.transport.load(session, hashes[num_loaded:], page_ids[num_loaded:len(keys)])
                if num_ready == 0:
                    break
                num_loaded += num_ready
        except (KvtierError, ValueError, RuntimeError) as error:
            self._failed(session, error, "load")
            num_loaded = 0
        self.stats.add(loaded_pages=num_loaded, missed_pages=len(keys) - num_loaded)
        return [True] * num_loaded + [False] * (len(keys) - num_loaded)

    def _hashes(self, session: Session, keys: Sequence[str]) -> list[BlockHash]:
        return session.namespace.foreign_keys(KEY_SCHEME, keys)

    def _failed(self, session: Session, error: BaseException, call: str) -> None:
        if isinstance(error, KvtierError):
            self.link.failed(session, error)
        self.stats.add(failed_calls=1)
        self._num_failures += 1
        if self._num_failures == 1 or self._num_failures % 100 == 0:
            log.warning("kvtierd SGLang storage: a %s failed (%s: %s); a miss for SGLang; %d failed so far",
                        call, type(error).__name__, error, self._num_failures)
