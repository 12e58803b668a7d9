"""A retention hint as a client sends it reaches the connector through the installed vLLM's own
objects: the OpenAI server's completion and chat requests put `kv_transfer_params` in their
SamplingParams, and the engine's Request hands it to the scheduler side as `kv_transfer_params`."""

from __future__ import annotations

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvtierd.connectors.vllm.retention_hints import PromptRetention, parse_retention

HINT = {"kvtierd_retention": {"session": "agent-7", "priority": "high", "ttl_s": 300, "end_token": 64}}


def engine_request(sampling_params) -> Request:
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request("r", list(range(100)), sampling_params, None, block_hasher=get_request_block_hasher(32, hash_fn))


@pytest.mark.parametrize("api_request", [
    CompletionRequest(model="m", prompt=list(range(100)), kv_transfer_params=HINT),
    ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], kv_transfer_params=HINT),
], ids=["completion", "chat"])
def test_kv_transfer_params_of_an_openai_request_reach_the_engines_request(api_request):
    request = engine_request(api_request.to_sampling_params(max_tokens=4, default_sampling_params={}))
    assert request.kv_transfer_params == HINT
    assert parse_retention(request.kv_transfer_params, request.num_prompt_tokens) == \
        PromptRetention("agent-7", "high", 300.0, 0, 64)
