"""Which of vLLM's KV cache groups the connector serves, how their blocks are keyed, and what it refuses
(in one line naming the kind), on configs shaped as the real engines' (Gemma-3, Qwen3-Next, DeepSeek-V2)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtierd.connectors.vllm.kv_groups import GroupKind, UnsupportedModel, engine_groups, group_block_hash
from tests.connectors.vllm import vllm_fakes
from tests.connectors.vllm.vllm_fakes import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

ATTENTION = FullAttentionSpec(32, 2, 64, torch.bfloat16)  # a 16 KiB page


@dataclasses.dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """DeepSeek-V2's latent: one 576-wide vector a token, no separate V."""

    head_size_v: int = 0

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.head_size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ChunkedLocalAttentionSpec(vllm_fakes.AttentionSpec):
    attention_chunk_size: int = 64


@dataclasses.dataclass(frozen=True)
class CrossAttentionSpec(vllm_fakes.AttentionSpec):
    pass


def config(*specs, **fields) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{2 * i + j}.attn" for j in range(2)], spec)
              for i, spec in enumerate(specs)]
    return KVCacheConfig("LBHNC", groups, **fields)


def test_gemma_style_sliding_window_and_full_attention_are_two_served_groups():
    groups = engine_groups(config(SlidingWindowSpec(32, 2, 64, torch.bfloat16, 64), ATTENTION), prefix_caching=True)
    assert [(g.group_id, g.kind, g.window_tokens) for g in groups.groups] == [(0, GroupKind.SLIDING, 64),
                                                                             (1, GroupKind.FULL, 0)]
    assert [g.num_window_blocks for g in groups.groups] == [2, 0]  # cdiv(63, 32): vLLM's rule
    assert (groups.block_size, groups.page_nbytes, groups.slot_num_layers) == (32, 16384, 2)
    assert not groups.uniform_attention and not groups.has_mamba


def test_a_mamba_group_needs_prefix_caching_and_holds_one_state_block():
    mamba = MambaSpec(32, 16384)
    groups = engine_groups(config(mamba, ATTENTION), prefix_caching=True)
    assert [g.kind for g in groups.groups] == [GroupKind.MAMBA, GroupKind.FULL] and groups.has_mamba
    assert groups.groups[0].num_window_blocks == 1
    with pytest.raises(UnsupportedModel, match="prefix caching") as refused:
        engine_groups(config(mamba, ATTENTION), prefix_caching=False)
    assert "\n" not in str(refused.value)
    with pytest.raises(UnsupportedModel, match="speculative"):
        engine_groups(config(dataclasses.replace(mamba, num_speculative_blocks=2), ATTENTION), prefix_caching=True)


def test_mla_latents_are_full_attention_but_not_plain_k_and_v():
    groups = engine_groups(config(MLAAttentionSpec(32, 1, 576, torch.bfloat16)), prefix_caching=True)
    assert [g.kind for g in groups.groups] == [GroupKind.FULL] and groups.page_nbytes == 36864
    assert not groups.uniform_attention  # served as opaque pages
    assert engine_groups(config(ATTENTION), prefix_caching=False).uniform_attention


@pytest.mark.parametrize("spec", [ChunkedLocalAttentionSpec(32, 2, 64, torch.bfloat16),
                                  CrossAttentionSpec(32, 2, 64, torch.bfloat16)], ids=lambda spec: type(spec).__name__)
def test_an_unserved_kind_is_refused_in_one_line_naming_it(spec):
    with pytest.raises(UnsupportedModel, match=type(spec).__name__) as refused:
        engine_groups(config(ATTENTION, spec), prefix_caching=True)
    assert "\n" not in str(refused.value)


def test_groups_of_different_block_or_page_sizes_and_unrestorable_groups_are_refused():
    with pytest.raises(UnsupportedModel, match="block size"):
        engine_groups(config(ATTENTION, FullAttentionSpec(16, 4, 64, torch.bfloat16)), prefix_caching=True)
    with pytest.raises(UnsupportedModel, match="not prefix-cacheable"):
        engine_groups(config(ATTENTION, ATTENTION, prefix_cacheable_group_ids=[0]), prefix_caching=True)


def test_vllm_hashes_at_a_finer_grain_are_read_at_the_block_boundaries():
    groups = engine_groups(config(ATTENTION, hash_block_size=16), prefix_caching=True)
    assert groups.chain_hashes([b"a", b"b", b"c", b"d", b"e"]) == [b"b", b"d"]  # the hash ending each block
    with pytest.raises(UnsupportedModel, match="does not divide"):
        engine_groups(config(ATTENTION, hash_block_size=12), prefix_caching=True)


def test_group_keys_differ_per_group_keep_group_zeros_and_their_size():
    block_hash = bytes(range(32))
    keys = [group_block_hash(block_hash, g) for g in range(3)]
    assert keys[0] == block_hash and len(set(keys)) == 3 and {len(k) for k in keys} == {32}
    assert group_block_hash(bytes(16), 1) != bytes(16) and len(group_block_hash(bytes(16), 1)) == 16
    assert group_block_hash(block_hash, 2) == keys[2]  # a pure function: every process derives the same keys


def test_the_signature_names_the_groups_and_changes_with_their_layers():
    specs = (SlidingWindowSpec(32, 2, 64, torch.bfloat16, 64), ATTENTION)
    signature = engine_groups(config(*specs), prefix_caching=True).signature()
    assert signature.startswith("sliding64x2,fullx2#")
    swapped = config(*specs)
    swapped.kv_cache_groups[0].layer_names.reverse()
    assert engine_groups(swapped, prefix_caching=True).signature() != signature
