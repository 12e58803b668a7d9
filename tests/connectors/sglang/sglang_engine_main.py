"""One real SGLang engine (sglang.Engine, the CPU scaffolding of scripts/install-sglang-cpu) for the
sglang lane's tests and bench_sglang; run with .venv-sglang's python:

    sglang_engine_main.py MODEL_DIR OUT_JSON --prompts FILE [--address A] [--token T] ...

Sends each prompt (token ids) greedily, one after the other, and writes OUT_JSON: per prompt the output
token ids, `cached_tokens`, SGLang's `cached_tokens_details` (device, host, storage) and the seconds
to its first token (a request of max_new_tokens 1 first, when --ttft); then, with --address, the
daemon's hit counts. Without --address the engine runs HiCache with no storage tier.

--wait-stored N: after the prompts, wait until the daemon holds N pages of this model (SGLang
writes through to storage in the background), up to 120 s, and record whether it did.
--pause-after K / --resume-file F: after K prompts, print "paused" and wait for F to exist.
--flush-between: flush SGLang's own caches (device and host) before each prompt, so that a prefix
can only come from storage.
--turns FILE: conversations instead of prompts (run_turns); each turn in OUT_JSON's "turns".
--engine-kwargs JSON: Engine kwargs over the defaults (a benchmark's pool sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[3]
PAGE_SIZE = 16


def engine_kwargs(model_dir: str, address: str | None = None, token: str | None = None, **changes) -> dict:
    """sglang.Engine's kwargs (and, as flags, launch_server's): the CPU ones smoke.py names, kvtierd as the
    storage tier where `address` is given, then `changes`."""
    sys.path.insert(0, str(REPO / "scripts" / "sglang_cpu"))
    from smoke import ENGINE_KWARGS  # the kwargs this SGLang needs on a CPU, said there

    kwargs = {**ENGINE_KWARGS, "model_path": model_dir, "page_size": PAGE_SIZE, "log_level": "warning"}
    if address:
        extra = {"backend_name": "kvtierd", "module_path": "kvtierd.connectors.sglang.hicache_storage",
                 "class_name": "KvtierdHiCacheStorage", "interface_v1": 1, "address": address,
                 "hicache_storage_pass_prefix_keys": True, "timeout_s": 2, "retry_after_s": 1}
        if token:
            extra["token"] = token
        kwargs.update(hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(extra))
    return {**kwargs, **changes}


def server_flags(kwargs: dict) -> list[str]:
    """`python -m sglang.launch_server`'s flags for Engine kwargs (True: the bare flag)."""
    flags: list[str] = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def daemon_pages(address: str, token: str | None) -> int:
    """The pages of this caller's tenant the daemon holds in T0, over its SGLang layouts."""
    from kvtierd.client import KvtierClient

    with KvtierClient(address, token=token, timeout_s=5) as client:
        usage = client.tenant_stats()
    return sum(u.num_t0_cached_blocks for u in usage if "@sglang-" in u.model_id)


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_json")
    parser.add_argument("--prompts")
    parser.add_argument("--turns", help="a JSON file of conversations: {users: [tokens...], questions: [tokens...]}")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--address")
    parser.add_argument("--token")
    parser.add_argument("--wait-stored", type=int, default=0)
    parser.add_argument("--pause-after", type=int, default=-1)
    parser.add_argument("--resume-file")
    parser.add_argument("--flush-between", action="store_true")
    parser.add_argument("--ttft", action="store_true")
    parser.add_argument("--engine-kwargs", default="{}")
    args = parser.parse_args()

    import sglang

    started = time.monotonic()
    engine = sglang.Engine(**engine_kwargs(args.model_dir, args.address, args.token, **json.loads(args.engine_kwargs)))
    result: dict = {"start_s": time.monotonic() - started, "output_token_ids": [], "cached_tokens": [],
                    "cached_tokens_details": [], "ttft_s": []}
    print("sglang_engine_main: ready", flush=True)
    try:
        if args.turns:
            result["turns"] = run_turns(engine, json.loads(pathlib.Path(args.turns).read_text()), args)
        for index, prompt in enumerate(json.loads(pathlib.Path(args.prompts).read_text()) if args.prompts else []):
            if index == args.pause_after:
                print("sglang_engine_main: paused", flush=True)
                assert args.resume_file, "--pause-after needs --resume-file"
                wait_for(lambda: os.path.exists(args.resume_file), 600)
            turn = request(engine, prompt, args)
            for key in ("output_token_ids", "cached_tokens", "cached_tokens_details", "ttft_s"):
                result[key].append(turn[key])
        if args.address and args.wait_stored:
            result["stored"] = wait_for(lambda: daemon_pages(args.address, args.token) >= args.wait_stored, 120)
    finally:
        engine.shutdown()
    pathlib.Path(args.out_json).write_text(json.dumps(result))
    return 0


def request(engine, prompt: list[int], args: argparse.Namespace) -> dict:
    """One prompt, greedy: (with --ttft) a request of one token first, its seconds the time to first
    token; then the answer. Its cached tokens are the first request's (where its prefix came from)."""
    if args.flush_between:
        engine.flush_cache()
    ttft_s = None
    first = None
    if args.ttft:
        began = time.perf_counter()
        first = engine.generate(input_ids=prompt, sampling_params={"temperature": 0.0, "max_new_tokens": 1})
        ttft_s = time.perf_counter() - began
    out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0.0, "ignore_eos": True,
                                                              "max_new_tokens": args.max_tokens})
    meta = (first or out)["meta_info"]
    return {"output_token_ids": list(out["output_ids"]), "cached_tokens": meta["cached_tokens"],
            "cached_tokens_details": meta.get("cached_tokens_details") or {}, "ttft_s": ttft_s}


def run_turns(engine, turns: dict, args: argparse.Namespace) -> list[dict]:
    """Conversations taken in turn: each round, each user sends their history plus the round's question
    and the answer joins the history (a growing, resent prompt, as a chat client sends it)."""
    histories = [list(user) for user in turns["users"]]
    done = []
    for round_index, question in enumerate(turns["questions"]):
        for user, history in enumerate(histories):
            prompt = history + question
            turn = request(engine, prompt, args)
            history[:] = prompt + turn["output_token_ids"]
            done.append({"user": user, "round": round_index, "prompt_tokens": len(prompt), **turn})
    return done


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU path (scripts/sglang_cpu/smoke.py says why)
    sys.exit(main())
