"""vLLM's KV cache groups as the kvtierd connector serves them: which groups, what a block of each
holds, how its blocks are keyed, and the one daemon layout they share.

vLLM 0.32's hybrid memory allocator splits a model's layers into KV cache groups with one block
table each (`KVCacheConfig.kv_cache_groups`, vllm/v1/kv_cache_interface.py): full attention, sliding
window (Gemma 2/3, gpt-oss), Mamba / linear attention (Qwen3-Next's GDN), MLA latents (DeepSeek
V2/V3). Every group's block ids come from one pool, groups alias the same bytes (a block id
belongs to one group at a time), and pages are padded to one size, so a block of group g is
`len(layers of g)` pages of `page_size_bytes` (engine_pages.py moves them as raw bytes).

Hits, as vLLM's own managers compute them (vllm/v1/core/single_type_kv_cache_manager.py):
- full attention, MLA included: the chain's leading blocks;
- sliding window: the `cdiv(window - 1, block_size)` blocks before the hit's end
  (SlidingWindowManager._contiguous_blocks_for_hit); vLLM's table holds its null block (id 0) for
  the earlier ones, which are never loaded;
- Mamba / linear attention in vLLM's "align" mode: the state at the hit's boundary, which vLLM
  keeps in the block just before it (MambaManager.find_longest_cache_hit). Without prefix caching
  vLLM keeps only the running state, so there is no state at a block boundary to store or load:
  such a model is refused.
Also refused at start, in one line naming the kind: any other spec (chunked local attention,
cross attention, sink, sparse-indexer wrappers), Mamba with speculative or checkpoint blocks, a
transferable group that is not prefix-cacheable (a hit would leave its KV unwritten), and groups
of different block sizes.

One daemon layout per (model, TP rank) holds every group: a slot is `max layers in a group` pages,
a group's block fills the first `len(layers)` of them. Group g's block at chain position i is keyed
by vLLM's block hash of that position (the hash that ends at its last token), through blake2b
personalised with g for g > 0, so that no group's bytes can be read as another's; group 0 keeps
vLLM's hash, so a one-group model keeps the keys and layout of earlier releases.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Any

from kvtierd.layout import DTYPES, FLOAT_DTYPES

NULL_BLOCK_ID = 0  # vLLM's null block: the first its BlockPool pops (vllm/v1/core/block_pool.py)


class UnsupportedModel(ValueError):
    """The engine's KV cache cannot be served by this connector; the message is one line."""


class GroupKind(str, enum.Enum):
    FULL = "full"  # full attention, MLA latents included: every block up to the hit
    SLIDING = "sliding"  # sliding-window attention: the window before the hit
    MAMBA = "mamba"  # linear attention / SSM state: the block before the hit


@dataclasses.dataclass(frozen=True, slots=True)
class ServedGroup:
    """One of vLLM's KV cache groups the connector stores and loads."""

    group_id: int  # vLLM's index in kv_cache_groups (and in every per-group block id tuple)
    kind: GroupKind
    layer_names: tuple[str, ...]  # in vLLM's order; a block's pages go to the slot in this order
    page_nbytes: int  # one layer's page of one block, padding included
    block_size: int  # tokens per block
    window_tokens: int = 0  # sliding window only

    @property
    def block_nbytes(self) -> int:
        """One block's bytes in this group: a page per layer."""
        return self.page_nbytes * len(self.layer_names)

    @property
    def num_window_blocks(self) -> int:
        """How many blocks before a hit's end the group must hold: 0 for all of them (full
        attention), the window's `cdiv(window - 1, block_size)` (as vLLM), 1 for a Mamba state."""
        if self.kind is GroupKind.SLIDING:
            return max(1, math.ceil((self.window_tokens - 1) / self.block_size))
        return 1 if self.kind is GroupKind.MAMBA else 0


@dataclasses.dataclass(frozen=True)
class EngineGroups:
    """The engine's served groups and their common geometry.

    Invariants: `groups` is non-empty, ordered by group id; every group has `block_size` tokens a
    block; `hash_block_size` divides `block_size`; the layout's slot holds `slot_num_layers` pages
    of `page_nbytes`.
    """

    groups: tuple[ServedGroup, ...]
    block_size: int  # tokens per block, every group
    hash_block_size: int  # tokens per vLLM block hash (Request.block_hashes)
    page_nbytes: int
    uniform_attention: bool  # one full-attention group of plain K/V pages: the layout of earlier releases

    @property
    def slot_num_layers(self) -> int:
        return max(len(group.layer_names) for group in self.groups)

    @property
    def has_mamba(self) -> bool:
        return any(group.kind is GroupKind.MAMBA for group in self.groups)

    def chain_hashes(self, request_block_hashes: Sequence[bytes]) -> list[bytes]:
        """vLLM's block hashes at this block size: position i's is the hash ending at its last token."""
        ratio = self.block_size // self.hash_block_size
        hashes = [bytes(h) for h in request_block_hashes]
        return hashes if ratio == 1 else hashes[ratio - 1::ratio]

    def signature(self) -> str:
        """A readable name of the group structure, with a digest of everything that places bytes."""
        parts = [f"{g.kind.value}{g.window_tokens or ''}x{len(g.layer_names)}" for g in self.groups]
        digest = hashlib.sha256(repr([(g.group_id, g.kind.value, g.window_tokens, g.layer_names, g.page_nbytes)
                                      for g in self.groups]).encode()).hexdigest()[:8]
        return f"{','.join(parts)}#{digest}"


def group_block_hash(block_hash: bytes, group_id: int) -> bytes:
    """The key of group `group_id`'s block at the position vLLM hashed as `block_hash`."""
    if group_id == 0:
        return block_hash
    return hashlib.blake2b(block_hash, digest_size=len(block_hash), person=b"kvtierd.vllm.grp",
                           salt=struct.pack("<Q", group_id)).digest()


def _spec_class_names(spec: Any) -> set[str]:
    return {cls.__name__ for cls in type(spec).__mro__}


def _spec_kind(spec: Any, prefix_caching: bool) -> GroupKind:
    names = _spec_class_names(spec)
    kind_name = type(spec).__name__
    if names & {"SinkFullAttentionSpec", "UniformTypeKVCacheSpecs", "ChunkedLocalAttentionSpec",
                "CrossAttentionSpec", "EncoderOnlyAttentionSpec", "SlidingWindowMLASpec", "RSWASpec"}:
        raise UnsupportedModel(f"the kvtierd connector does not serve KV cache groups of kind {kind_name}")
    if "MambaSpec" in names:
        if not prefix_caching or getattr(spec, "mamba_cache_mode", "none") != "align":
            raise UnsupportedModel(
                "the kvtierd connector serves linear-attention / Mamba layers only with vLLM's prefix caching on "
                "(--enable-prefix-caching: mamba_cache_mode 'align'); without it vLLM keeps only the running state, "
                "so no state at a block boundary exists to store or load")
        if getattr(spec, "num_speculative_blocks", 0) or getattr(spec, "num_prefill_checkpoint_blocks", 0):
            raise UnsupportedModel("the kvtierd connector does not serve Mamba groups with speculative or "
                                   "checkpoint blocks")
        return GroupKind.MAMBA
    if "SlidingWindowSpec" in names:
        return GroupKind.SLIDING
    if "FullAttentionSpec" in names:  # MLAAttentionSpec is one
        return GroupKind.FULL
    raise UnsupportedModel(f"the kvtierd connector does not serve KV cache groups of kind {kind_name}")


def is_plain_attention(spec: Any) -> bool:
    """K and V pages of one float dtype, nothing else in them (no MLA latent, no padding)."""
    names = _spec_class_names(spec)
    if "MLAAttentionSpec" in names or not names & {"FullAttentionSpec", "SlidingWindowSpec"}:
        return False
    dtype = str(getattr(spec, "dtype", "")).removeprefix("torch.")
    head_size = getattr(spec, "head_size", 0)
    plain_nbytes = 2 * spec.block_size * getattr(spec, "num_kv_heads", 0) * head_size * DTYPES.get(dtype, 0)
    return (dtype in FLOAT_DTYPES and getattr(spec, "head_size_v", head_size) == head_size
            and spec.page_size_bytes == plain_nbytes)


def engine_groups(kv_cache_config: Any, *, prefix_caching: bool) -> EngineGroups:
    """The served groups of vLLM's KVCacheConfig; UnsupportedModel (one line) if any cannot be."""
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise UnsupportedModel("the engine has no KV cache groups")
    transfer_ids = _ids(kv_cache_config, "transfer_group_ids",
                        [i for i, g in enumerate(groups) if getattr(g, "enable_kv_transfer", True)])
    cacheable_ids = _ids(kv_cache_config, "prefix_cacheable_group_ids", transfer_ids)
    if set(transfer_ids) - set(cacheable_ids):
        names = sorted(type(groups[i].kv_cache_spec).__name__ for i in set(transfer_ids) - set(cacheable_ids))
        raise UnsupportedModel(f"the kvtierd connector cannot restore KV cache groups that are not "
                               f"prefix-cacheable ({', '.join(names)})")
    served = []
    for group_id in cacheable_ids:
        group = groups[group_id]
        spec = group.kv_cache_spec
        kind = _spec_kind(spec, prefix_caching)
        window = int(getattr(spec, "sliding_window", 0) or 0) if kind is GroupKind.SLIDING else 0
        served.append(ServedGroup(group_id, kind, tuple(group.layer_names), int(spec.page_size_bytes),
                                  int(spec.block_size), window))
    block_sizes = {g.block_size for g in served}
    page_sizes = {g.page_nbytes for g in served}
    if len(block_sizes) != 1 or len(page_sizes) != 1:
        raise UnsupportedModel(f"the kvtierd connector needs one block size and one page size across KV cache "
                               f"groups, got block sizes {sorted(block_sizes)} and pages {sorted(page_sizes)} bytes")
    (block_size,), (page_nbytes,) = block_sizes, page_sizes
    hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None) or block_size)
    if block_size % hash_block_size:
        raise UnsupportedModel(f"vLLM hashes every {hash_block_size} tokens, which does not divide the block "
                               f"size {block_size}")
    first_spec = groups[served[0].group_id].kv_cache_spec
    uniform = len(served) == 1 and served[0].kind is GroupKind.FULL and is_plain_attention(first_spec)
    return EngineGroups(tuple(served), block_size, hash_block_size, page_nbytes, uniform)


def _ids(kv_cache_config: Any, name: str, default: list[int]) -> list[int]:
    value = getattr(kv_cache_config, name, None)
    return list(default if value is None else value)
