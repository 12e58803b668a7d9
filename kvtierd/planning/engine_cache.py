"""An engine's own KV cache as the tier simulator sees it: blocks of running requests and an LRU
of cached ones, together at most the engine's blocks.

Modelled on vLLM's KV cache manager (vllm/v1/core/block_pool.py, kv_cache_manager.py): a running
request holds its prompt's blocks (the cached ones it hit, shared, and new ones) until it finishes;
then its full blocks become cached, tail first (vLLM frees a request's blocks in reverse order so
its tail is evicted first); a new block evicts the least recently used cached one. A block in use is
never evicted, so while many requests run the cache holds only what they leave free. Requests the
engine would queue for want of blocks are not modelled: the blocks in use may exceed the capacity
for a while, and then nothing stays cached.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from kvtierd.daemon_key import DaemonKey


class EngineCache:
    """Invariants: a key is cached or in use, never both; `num_in_use_blocks` counts each running
    request's private (not yet full or not cached) blocks plus every distinct key in use once;
    after `start`, cached + in use <= `capacity_blocks` unless the blocks in use alone exceed it."""

    def __init__(self, capacity_blocks: int) -> None:
        assert capacity_blocks >= 0, "an engine of a negative number of blocks"
        self.capacity_blocks = capacity_blocks
        self.cached: collections.OrderedDict[DaemonKey, None] = collections.OrderedDict()  # LRU first
        self.in_use: collections.Counter[DaemonKey] = collections.Counter()  # running requests per key
        self.num_private_blocks = 0  # running requests' blocks without a key (the partial last one)

    @property
    def num_in_use_blocks(self) -> int:
        return len(self.in_use) + self.num_private_blocks

    def start(self, keys: Sequence[DaemonKey], num_private_blocks: int = 1) -> int:
        """A request whose prompt's full blocks are `keys` starts: it hits the leading run cached or
        in use (returns how many), holds all its blocks until `finish`; new blocks evict."""
        num_hits = next((i for i, key in enumerate(keys) if key not in self.cached and key not in self.in_use),
                        len(keys))
        for key in keys:
            self.cached.pop(key, None)
            self.in_use[key] += 1
        self.num_private_blocks += num_private_blocks
        while self.cached and len(self.cached) + self.num_in_use_blocks > self.capacity_blocks:
            self.cached.popitem(last=False)
        return num_hits

    def finish(self, keys: Sequence[DaemonKey], num_private_blocks: int = 1) -> None:
        """The request of `start(keys, num_private_blocks)` finished: its blocks no other running
        request holds become cached, tail first (its tail leaves first)."""
        self.num_private_blocks -= num_private_blocks
        assert self.num_private_blocks >= 0, "finished more private blocks than started"
        for key in reversed(keys):
            assert self.in_use[key] > 0, "a key finished that was not in use"
            self.in_use[key] -= 1
            if not self.in_use[key]:
                del self.in_use[key]
                self.cached[key] = None
        while self.cached and len(self.cached) + self.num_in_use_blocks > self.capacity_blocks:
            self.cached.popitem(last=False)
