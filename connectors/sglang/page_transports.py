"""The two ways a page store moves SGLang's pages to and from the daemon, behind one interface.

- `MappedPool` (the daemon on this node, the default): the daemon's pool is mapped into SGLang's
  process. A store is Acquire for store (pages the daemon holds come first and are not copied), one
  copy of each new page into its fresh pool block, and a Commit that also releases: 2 RPCs. A load is
  Acquire of the hit, Wait while lower tiers load, one copy of each block into its page, Release.
- `PutGet` (a daemon the process cannot map: another host, over TCP): the pages travel as bytes in
  the RPCs, Put (blocks the daemon holds are not written again) and Get (the leading blocks it holds,
  from any tier). One RPC each way, and a copy more than the mapped pool.

Both commit pages without tokens (SGLang never tells them) and both load the leading pages of a
chain whose first page's parent the daemon does not check.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from typing import Protocol

import torch

from kvtierd.block_hash import BlockHash
from kvtierd.client import Session
from kvtierd.connectors.sglang.host_pages import HostPages
from kvtierd.errors import KvtierError
from kvtierd.token_bytes import NO_TOKENS

log = logging.getLogger(__name__)


class PageTransport(Protocol):
    def store(self, session: Session, hashes: list[BlockHash], page_ids: list[int],
              parent: bytes | None) -> tuple[int, int]:
        """Store the pages of one chain (`parent`: the hash before it, None for the root): (pages
        written, pages the daemon already held)."""
        ...

    def load(self, session: Session, hashes: list[BlockHash], page_ids: list[int]) -> int:
        """Load the leading pages of one chain that the daemon holds; how many were loaded."""
        ...


class MappedPool:
    """Pages through the daemon's pool mapped into this process.

    Invariant: a page is copied into a pool block only between that block's Acquire and its Commit,
    and out of one only between its Acquire (and Wait) and Release."""

    def __init__(self, pages: HostPages) -> None:
        self.pages = pages
        self._request_ids = itertools.count()

    def store(self, session: Session, hashes: list[BlockHash], page_ids: list[int],
              parent: bytes | None) -> tuple[int, int]:
        request_id = f"sglang-store-{next(self._request_ids)}"
        acquired = session.acquire(request_id, hashes, 0, for_store=True, parent_hash=parent)
        held = True
        try:
            num_hits = acquired.num_t0_hit_blocks + acquired.num_loading_blocks
            fresh_ids = acquired.block_ids[num_hits:len(hashes)]
            if fresh_ids:
                pool = _pool_bytes(session)
                self.pages.copy_out(page_ids[num_hits:], [pool[block_id] for block_id in fresh_ids])
                if pool.device.type == "cuda":
                    torch.cuda.current_stream(pool.device).synchronize()  # the bytes are in the pool before Commit
                committed = session.commit_and_release(request_id, fresh_ids, hashes[num_hits:], NO_TOKENS,
                                                       hashes[num_hits - 1] if num_hits else parent)
                held = not committed.released
            return len(fresh_ids), num_hits
        finally:
            if held:
                _release(session, request_id)

    def load(self, session: Session, hashes: list[BlockHash], page_ids: list[int]) -> int:
        request_id = f"sglang-load-{next(self._request_ids)}"
        acquired = session.acquire(request_id, hashes, 0, load_every_hit=True)
        try:
            num_ready = min(acquired.num_t0_hit_blocks + acquired.num_loading_blocks, len(hashes))
            if acquired.pending:
                num_ready = min(session.wait(request_id), num_ready)
            if num_ready:
                pool = _pool_bytes(session)
                blocks = [pool[block_id] for block_id in acquired.block_ids[:num_ready]]
                self.pages.copy_in(page_ids[:num_ready], blocks)
            return num_ready
        finally:
            _release(session, request_id)


class PutGet:
    """Pages as bytes in Put and Get (no mapped pool)."""

    def __init__(self, pages: HostPages) -> None:
        self.pages = pages

    def store(self, session: Session, hashes: list[BlockHash], page_ids: list[int],
              parent: bytes | None) -> tuple[int, int]:
        blocks = self.pages.read(page_ids).reshape(len(page_ids), -1).view(torch.uint8)
        result = session.client.put(session.layout, [(h, NO_TOKENS, block) for h, block in zip(hashes, blocks)],
                                    parent)
        return result.num_blocks - result.num_already_cached_blocks, result.num_already_cached_blocks

    def load(self, session: Session, hashes: list[BlockHash], page_ids: list[int]) -> int:
        blocks = session.client.get(session.layout, hashes)
        self.pages.copy_in(page_ids[:len(blocks)], _read_only_rows([data for _, data in blocks]))
        return len(blocks)


def _read_only_rows(payloads: list[bytes]) -> list[torch.Tensor]:
    """A uint8 tensor over each received block's bytes, no copy. torch warns that such a buffer is not
    writable; these rows are only read (copied into the pages)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return [torch.frombuffer(payload, dtype=torch.uint8) for payload in payloads]


def _pool_bytes(session: Session) -> torch.Tensor:
    """The session's mapped pool as one row of bytes per block."""
    assert session.pool is not None, "a MappedPool's link maps the pool"
    tensor = session.pool.tensor
    return tensor.view(tensor.shape[0], -1).view(torch.uint8)


def _release(session: Session, request_id: str) -> None:
    """Release the request's blocks; a failure is logged, not raised: the daemon reclaims the blocks of
    a session whose lease lapsed, and SGLang's call already has its answer."""
    try:
        session.release(request_id)
    except KvtierError as error:
        log.warning("kvtierd: releasing %s failed (%s); the daemon reclaims its blocks when the session's lease "
                    "lapses", request_id, error)
