"""The reference runner on real weights (SmolLM2-135M-Instruct, a Q4_1 GGUF file).

Our GGUF loader (connectors/reference/gguf_weights.py) is checked against transformers' own GGUF
loading: the same dequantized tensors, and LlamaForCausalLM's logits at every prefill position
and every decode step within fp32 tolerance; greedy generation through the paged pool equals
`model.generate` token for token. The tokenizer and chat template come from the file too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtierd.connectors.reference.chat_tokenizer import ChatTokenizer
from kvtierd.connectors.reference.forward_batch import ForwardBatch, SequenceChunk
from kvtierd.connectors.reference.gguf_weights import gguf_config, load_gguf, open_gguf, unpermute_rotary_rows
from kvtierd.connectors.reference.kv_backend import PrivateKv
from kvtierd.connectors.reference.llama_model import LlamaModel
from kvtierd.connectors.reference.llama_weights import expected_shapes
from kvtierd.connectors.reference.runner import GenerationRequest, ReferenceRunner
from tests.connectors.reference.connector_factories import empty_pool

transformers = pytest.importorskip("transformers")  # the demo extra, in dev: CI has it

ATOL = 5e-4  # fp32 through 30 layers, logits up to ~40: observed 7e-5
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    config, weights = load_gguf(smollm2_gguf)
    return config, weights, LlamaModel(config, weights)


@pytest.fixture(scope="module")
def theirs(smollm2_gguf):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf) -> ChatTokenizer:
    return ChatTokenizer.from_gguf(smollm2_gguf)


def test_the_gguf_config_is_smollm2_135m(smollm2_gguf):
    config = gguf_config(open_gguf(smollm2_gguf))
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.rope_theta == 100000.0


def test_every_tensor_has_its_shape_and_equals_transformers_dequantization(ours, theirs):
    """Tied embeddings: no lm_head in the file; every other parameter bit for bit as transformers loads it."""
    config, weights, _ = ours
    shapes = expected_shapes(config)
    assert "lm_head.weight" not in shapes and set(weights) == set(shapes)
    state = theirs.state_dict()
    for name, tensor in weights.items():
        assert tuple(tensor.shape) == shapes[name], name
        assert torch.equal(tensor, state[name]), name
    assert torch.equal(state["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_unpermute_undoes_llama_cpp_rotary_row_order():
    """llama.cpp's converter interleaves each head's two rotary halves; row j·d/2+i was moved to 2i+j."""
    num_heads, head_dim, columns = 3, 8, 5
    hf = np.arange(num_heads * head_dim * columns, dtype=np.float32).reshape(num_heads * head_dim, columns)
    permuted = np.empty_like(hf)
    for head in range(num_heads):
        for i in range(head_dim // 2):
            for j in range(2):
                permuted[head * head_dim + 2 * i + j] = hf[head * head_dim + j * head_dim // 2 + i]
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted, num_heads), hf)


def test_tokenizer_round_trips_and_renders_the_chat_template(tokenizer):
    text = "Paged attention keeps KV in blocks of 16 tokens, and kvtierd keeps them in tiers."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    prompt = tokenizer.prompt([{"role": "system", "content": "Be brief."}] + QUESTION)
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" \
               "<|im_start|>assistant\n"
    assert prompt == tokenizer.encode(rendered)
    assert prompt[0] == 1 and tokenizer.eos_token_id == 2  # <|im_start|>, <|im_end|>
    # no system message: the template brings SmolLM2's own
    assert tokenizer.decode(tokenizer.prompt(QUESTION)).startswith("system\nYou are a helpful AI assistant "
                                                                   "named SmolLM")


def test_prefill_logits_match_transformers_at_every_position(ours, theirs, tokenizer):
    config, _, model = ours
    tokens = tokenizer.prompt(QUESTION)
    block_size = 16
    num_blocks = -(-len(tokens) // block_size)
    table = list(range(num_blocks))[::-1]  # reversed: a block table is not the identity
    pool = empty_pool(config, num_blocks + 1, block_size)
    logits = model.forward(ForwardBatch.build([SequenceChunk(tokens, 0, table)], block_size), pool, all_logits=True)
    with torch.no_grad():
        expected = theirs(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_greedy_generation_equals_transformers_generate_and_every_step_logits(ours, theirs, tokenizer):
    """Through the runner on a private paged pool: the reply to a real question, token for token."""
    config, _, model = ours
    tokens = tokenizer.prompt(QUESTION)
    runner = ReferenceRunner(model, PrivateKv(config.layout("smollm2", 16), 16), record_logits=True)
    result = runner.generate([GenerationRequest("q", tokens, 12, stop_token_id=tokenizer.eos_token_id)])[0]
    with torch.no_grad():
        generated = theirs.generate(torch.tensor([tokens]), max_new_tokens=12, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
    expected = generated.sequences[0, len(tokens):].tolist()
    assert result.output_token_ids[0] == expected
    assert tokenizer.decode(expected) == "The capital of France is Paris."
    for step, (ours_logits, theirs_logits) in enumerate(zip(result.step_logits[0], generated.logits)):
        torch.testing.assert_close(ours_logits, theirs_logits[0].float(), atol=ATOL, rtol=0, msg=f"step {step}")
