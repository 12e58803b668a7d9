"""A request's daemon keys: one per KV cache group and chain position, from vLLM's own block hashes
(kv_groups.py, `group_block_hash`: the first group's key is the chain hash, another's is keyed by its id)."""

from __future__ import annotations

from typing import Any

from kvtierd.connectors.vllm.kv_groups import EngineGroups, group_block_hash


class RequestKeys:
    """A request's keys per group and chain position, derived once each as vLLM's hashes grow.

    Invariant: `keys[g][i]` is group_block_hash(chain hash of position i, group id of g)."""

    def __init__(self, engine: EngineGroups) -> None:
        self.engine = engine
        self.keys: list[list[bytes]] = [[] for _ in engine.groups]
        self._num_hashes_read = 0

    def update(self, request: Any) -> int:
        """Derive the keys of positions vLLM hashed since the last call; returns how many positions have keys."""
        hashes = request.block_hashes
        if len(hashes) > self._num_hashes_read:
            ratio = self.engine.block_size // self.engine.hash_block_size
            start = len(self.keys[0])
            new = self.engine.chain_hashes(hashes[start * ratio:])
            for group, keys in zip(self.engine.groups, self.keys):
                keys.extend(group_block_hash(h, group.group_id) for h in new)
            self._num_hashes_read = len(hashes)
        return len(self.keys[0])
