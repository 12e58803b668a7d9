"""One real vLLM engine (the CPU build) of a tiny model kind (tests/connectors/vllm/model_kinds.py),
serving token prompts one after the other, with or without the kvtierd connector.

    .venv-vllm/bin/python -P tests/connectors/vllm/kinds_engine_main.py KIND MODEL_DIR OUT_JSON \
        --prompts PROMPTS_JSON [--address ADDR] [--no-prefix-caching]

With `--address` the engine loads tests.connectors.vllm.recording_connector (KvtierdConnector that
also records its blocks' digests, KVTIERD_TEST_RECORD) with vLLM's prefix cache on; without it the
engine is the reference. Greedy decoding; OUT_JSON holds per prompt the output token ids, each
sampled token's logprob, `num_cached_tokens`, and vLLM's `prompt_tokens_cached_by_source`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MAX_TOKENS = 8
# These engines run beside others on 2 cores: the tests prove what is stored and loaded, so a lookup or
# an RPC stalled by the load waits rather than counting a miss (the defaults are 1 s and 5 s).
TEST_EXTRA_CONFIG = {"lookup_timeout_s": 60.0, "timeout_s": 30.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind")
    parser.add_argument("model_dir")
    parser.add_argument("out_json")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--address")
    parser.add_argument("--no-prefix-caching", action="store_true", help="vLLM's prefix caching off")
    args = parser.parse_args()
    sys.path.insert(0, os.environ["KVTIERD_REPO"])
    from tests.connectors.vllm.model_kinds import KINDS

    kind = KINDS[args.kind]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtierd.connectors.vllm.metrics import cached_tokens_by_source
    from kvtierd.connectors.vllm.transfer_config import kv_transfer_config

    kwargs = dict(kind.engine_kwargs(), model=args.model_dir, disable_log_stats=False)
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.address is not None:
        config = kv_transfer_config(args.address, **TEST_EXTRA_CONFIG)
        config.update(kv_connector="RecordingConnector",
                      kv_connector_module_path="tests.connectors.vllm.recording_connector")
        kwargs["kv_transfer_config"] = config
    llm = LLM(**kwargs)
    with open(args.prompts) as f:
        prompts = json.load(f)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    result = {"output_token_ids": [], "logprobs": [], "num_cached_tokens": []}
    for prompt in prompts:  # one at a time: a prompt's stores are done before the next is looked up
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        completion = output.outputs[0]
        result["output_token_ids"].append(list(completion.token_ids))
        result["logprobs"].append([step[token].logprob for step, token in zip(completion.logprobs,
                                                                              completion.token_ids)])
        result["num_cached_tokens"].append(output.num_cached_tokens)
    result["cached_tokens_by_source"] = cached_tokens_by_source(llm)
    with open(args.out_json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM's engine core is a spawned process that re-imports this file
    main()
