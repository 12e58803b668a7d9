"""The reference runner's logits equal transformers' LlamaForCausalLM with the same weights.

transformers is a test dependency only; its model is built from a config, nothing downloaded.
Pools start filled with NaN: a read of a slot the runner never wrote poisons the logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtierd.connectors.reference.forward_batch import ForwardBatch, SequenceChunk
from kvtierd.connectors.reference.llama_config import LlamaConfig
from kvtierd.connectors.reference.llama_model import LlamaModel
from kvtierd.connectors.reference.llama_weights import load_weights, random_weights
from kvtierd.errors import InvalidArgument
from tests.connectors.reference.connector_factories import TOY, empty_pool, prompt

transformers = pytest.importorskip("transformers")  # listed in the dev extra: CI has it

ATOL = 1e-4  # fp32; the largest logit is of order 3-5

CONFIGS = {
    "gqa": TOY,
    "mha": dataclasses.replace(TOY, num_key_value_heads=4),
    "tied-mqa": dataclasses.replace(TOY, num_key_value_heads=1, tie_word_embeddings=True),
}


def hf_model(config: LlamaConfig, weights: dict[str, torch.Tensor]):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf())).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def pair(request):
    config = CONFIGS[request.param]
    weights = random_weights(config, seed=7)
    return config, LlamaModel(config, weights), hf_model(config, weights)


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_logits_match_transformers_at_every_position(pair, block_size):
    """All 37 positions of a prefill through a shuffled block table equal LlamaForCausalLM's."""
    config, ours, theirs = pair
    tokens = prompt(1, 37, config.vocab_size)
    table = [7, 2, 11, 0, 5, 9, 3, 8, 1, 10][:-(-37 // block_size)]
    pool = empty_pool(config, 12, block_size)
    logits = ours.forward(ForwardBatch.build([SequenceChunk(tokens, 0, table)], block_size), pool, all_logits=True)
    expected = hf_logits(theirs, tokens)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_every_greedy_decode_step_matches_transformers(pair):
    """Prefill, then 12 decode steps reading the paged cache: each step's logits equal a full
    transformers forward over the sequence so far, and the greedy tokens agree."""
    config, ours, theirs = pair
    block_size = 4
    tokens = prompt(2, 10, config.vocab_size)
    table = [3, 9, 1, 6, 0, 4, 8]  # room for 28 tokens
    pool = empty_pool(config, 10, block_size)
    logits = ours.forward(ForwardBatch.build([SequenceChunk(tokens, 0, table)], block_size), pool)[0]
    for _ in range(12):
        expected = hf_logits(theirs, tokens)[-1]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        token = int(expected.argmax())
        assert int(logits.argmax()) == token
        tokens.append(token)
        chunk = SequenceChunk([token], len(tokens) - 1, table, len(tokens) - 1)
        logits = ours.forward(ForwardBatch.build([chunk], block_size), pool)[0]


def test_a_batch_of_sequences_matches_each_alone(pair):
    """Three sequences in one varlen pass (a prefill, a suffix after a cached prefix, a decode
    step) with their own block tables give each one's transformers logits."""
    config, ours, theirs = pair
    block_size = 4
    pool = empty_pool(config, 24, block_size)
    a, b, c = prompt(3, 9, config.vocab_size), prompt(4, 14, config.vocab_size), prompt(5, 6, config.vocab_size)
    tables = {"a": [20, 3, 14], "b": [1, 22, 5, 17], "c": [8, 2]}
    # b's first 8 tokens and c's first 5 are in the cache already, computed in an earlier pass
    ours.forward(ForwardBatch.build([SequenceChunk(b[:8], 0, tables["b"]), SequenceChunk(c[:5], 0, tables["c"])],
                                    block_size), pool)
    chunks = [SequenceChunk(a, 0, tables["a"]), SequenceChunk(b[8:], 8, tables["b"], 8),
              SequenceChunk(c[5:], 5, tables["c"], 5)]
    logits = ours.forward(ForwardBatch.build(chunks, block_size), pool)
    for row, tokens in zip(logits, (a, b, c)):
        torch.testing.assert_close(row, hf_logits(theirs, tokens)[-1], atol=ATOL, rtol=0)


def test_a_fully_cached_prompt_recomputes_only_the_last_query_without_writing(pair):
    """When the whole prompt is cached the last token is run for its logits, and its cached KV
    (possibly in a committed, shared block) is not rewritten: the pool is unchanged."""
    config, ours, theirs = pair
    block_size = 4
    tokens = prompt(6, 12, config.vocab_size)
    table = [4, 0, 2, 5]
    pool = empty_pool(config, 6, block_size)
    ours.forward(ForwardBatch.build([SequenceChunk(tokens, 0, table)], block_size), pool)
    before = pool.clone()
    logits = ours.forward(ForwardBatch.build([SequenceChunk(tokens[-1:], 11, table, 12)], block_size), pool)
    assert torch.equal(pool.nan_to_num(), before.nan_to_num())
    torch.testing.assert_close(logits[0], hf_logits(theirs, tokens)[-1], atol=ATOL, rtol=0)


def test_safetensors_checkpoint_saved_by_transformers_loads_and_matches(tmp_path):
    """A checkpoint written by save_pretrained (config.json + model.safetensors) loads through
    the runner's own reader and config parser, and gives transformers' logits."""
    weights = random_weights(TOY, seed=11)
    theirs = hf_model(TOY, weights)
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    config = LlamaConfig.from_file(tmp_path / "config.json")
    assert config == TOY
    ours = LlamaModel(config, load_weights(tmp_path, config))
    tokens = prompt(8, 21, config.vocab_size)
    pool = empty_pool(config, 8, 4)
    logits = ours.forward(ForwardBatch.build([SequenceChunk(tokens, 0, list(range(6)))], 4), pool, all_logits=True)
    torch.testing.assert_close(logits, hf_logits(theirs, tokens), atol=ATOL, rtol=0)


def test_what_the_runner_does_not_model_is_refused():
    with pytest.raises(InvalidArgument, match="rope_scaling"):
        LlamaConfig.from_hf({**TOY.to_hf(), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(InvalidArgument, match="attention_bias"):
        LlamaConfig.from_hf({**TOY.to_hf(), "attention_bias": True})
    weights = random_weights(TOY)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(InvalidArgument, match="up_proj"):
        LlamaModel(TOY, weights)
