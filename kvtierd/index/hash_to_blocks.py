"""The prefix table of the device tier: each content hash → the blocks that hold it, oldest first.

Several blocks may hold one hash, as in vLLM's prefix cache (vllm/v1/core/block_pool.py,
BlockHashToBlockMap: "we don't de-duplicate the blocks in the cache", so block tables stay
append-only). A second copy appears when a request recomputes a block that is cached: vLLM always
recomputes a prompt's last token, so a fully cached prompt computes its last block again, and
that copy is committed too. A hit takes the oldest copy still indexed (vLLM's `get_one_block`
returns the first of its insertion-ordered dict); a copy leaves when its block is evicted for
reuse, and the next oldest then serves the hits.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.kv_block import KVBlock


class HashToBlocks:
    """Every committed block, by hash; the copy a hit takes first.

    Invariants (checked by tests/index/test_block_index_stateful.py after every step):
    - `first[h]` is the oldest indexed copy of `h`: the one a hit takes;
    - `_later[h]` holds the other copies, oldest first, and is never empty; `h` in `_later`
      implies `h` in `first`;
    - every copy carries `h` as its `block_hash`, and a block is a copy of one hash at most;
    - `num_duplicate_blocks` is the number of blocks in `_later`.
    Mutated only by BlockIndex under its lock. `first` is a plain dict, so a prefix walk looks a
    hash up at C speed; `_later` is empty unless some hash has two copies.
    """

    def __init__(self) -> None:
        self.first: dict[DaemonKey, KVBlock] = {}  # read by prefix walks; mutated only through these methods
        self._later: dict[DaemonKey, list[KVBlock]] = {}
        self.num_duplicate_blocks = 0

    def __len__(self) -> int:
        """How many distinct hashes are cached."""
        return len(self.first)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.first

    def __iter__(self) -> Iterator[DaemonKey]:
        return iter(self.first)

    def get(self, block_hash: DaemonKey) -> KVBlock | None:
        """The copy a hit takes (the oldest), or None."""
        return self.first.get(block_hash)

    def copies(self, block_hash: DaemonKey) -> list[KVBlock]:
        """Every block holding `block_hash`, oldest first."""
        block = self.first.get(block_hash)
        if block is None:
            return []
        return [block, *self._later.get(block_hash, ())]

    def insert(self, block_hash: DaemonKey, block: KVBlock) -> bool:
        """Index `block` as the newest copy of `block_hash`; True when it is the first copy.
        The caller sets `block.block_hash` and has checked that the block holds no hash yet."""
        if self.first.setdefault(block_hash, block) is block:
            return True
        self.add_copy(block_hash, block)
        return False

    def add_copy(self, block_hash: DaemonKey, block: KVBlock) -> None:
        """Index `block` as the newest copy of a hash that `first` already holds."""
        assert self.first[block_hash] is not block, f"block {block.block_id} indexed twice"
        self._later.setdefault(block_hash, []).append(block)
        self.num_duplicate_blocks += 1

    def remove(self, block: KVBlock) -> bool:
        """Unindex one copy (its block is reused or dropped); True when it was the last copy,
        so the hash left the tier. The block keeps its fields: the caller clears them."""
        block_hash = block.block_hash
        assert block_hash is not None, f"block {block.block_id} holds no hash"
        later = self._later.get(block_hash) if self._later else None
        if later is None:
            assert self.first.get(block_hash) is block, f"block {block.block_id} is not indexed"
            del self.first[block_hash]
            return True
        if self.first[block_hash] is block:
            self.first[block_hash] = later.pop(0)
        else:
            later.remove(block)  # ValueError if it was not indexed: a broken invariant
        if not later:
            del self._later[block_hash]
        self.num_duplicate_blocks -= 1
        return False

    def remove_many(self, blocks: list[KVBlock]) -> list[KVBlock]:
        """Unindex several copies; the ones that were the last of their hash, in order."""
        if not self.num_duplicate_blocks:  # one copy per hash: every hash leaves
            first = self.first
            for block in blocks:
                assert block.block_hash is not None, f"block {block.block_id} holds no hash"
                del first[block.block_hash]
            return blocks
        remove = self.remove
        return [block for block in blocks if remove(block)]

    def clear(self) -> None:
        self.first.clear()
        self._later.clear()
        self.num_duplicate_blocks = 0

    def all_blocks(self) -> Iterator[KVBlock]:
        """Every indexed block, each hash's copies oldest first."""
        later = self._later
        for block_hash, block in self.first.items():
            yield block
            yield from later.get(block_hash, ())
