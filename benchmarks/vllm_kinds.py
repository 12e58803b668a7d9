"""bench_vllm's rows per model kind: TTFT of a prefix restored from kvtierd by a new engine, beside
recompute and beside vLLM's own prefix hit, in the same run, on the tiny random-weight models of
tests/connectors/vllm/model_kinds.py (sliding window, linear attention, MLA, TP 2).

Per kind, four engine processes, each prompt a prefix of its own plus a suffix: `recompute` (no
connector, vLLM's prefix caching off) runs the second prompt of every pair; `vllm hit` (no
connector, prefix caching on) runs each pair, the second prompt hitting the first's prefix;
`store` (kvtierd) runs the first of each pair; `restored` (kvtierd, a new process) runs the
second of each pair, whose prefix only kvtierd holds. Every engine must produce recompute's first
tokens.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.connectors.vllm.model_kinds import KINDS  # noqa: E402

SUFFIX_TOKENS = 64
KIND_HEADERS = ["kind", "restored ms", "hit tokens", "recompute ms", "vLLM hit ms", "vs recompute", "vs vLLM hit"]


def kind_prompts(vocab_size: int, prefix_tokens: int, num_pairs: int) -> list[list[int]]:
    """Pairs of prompts: 2p and 2p + 1 share a prefix of their own, then differ."""
    def tokens(n: int, salt: int) -> list[int]:
        return [(7919 * i + 104729 * salt) % (vocab_size - 10) + 5 for i in range(n)]
    return [tokens(prefix_tokens, pair) + tokens(SUFFIX_TOKENS, 1000 + 2 * pair + second)
            for pair in range(num_pairs) for second in (0, 1)]


def write_model(python: str, kind_name: str, directory: str) -> None:
    subprocess.run([python, "-m", "tests.connectors.vllm.model_kinds", kind_name, directory], cwd=ROOT,
                   check=True, capture_output=True, timeout=600)


def engine_settings(kind_name: str) -> tuple[dict, dict[str, str]]:
    """(the kind's engine kwargs less prefix caching, which each phase sets; its environment)."""
    kwargs = KINDS[kind_name].engine_kwargs()
    kwargs.pop("enable_prefix_caching")
    kwargs.pop("max_model_len")
    return kwargs, KINDS[kind_name].env()


def measure_kind(kind_name: str, phases, start_daemon, num_pairs: int) -> dict:
    """The four phases of one kind on `phases` (bench_vllm.Phases over the kind's model and prompts)."""
    firsts, seconds = range(0, 2 * num_pairs, 2), range(1, 2 * num_pairs, 2)
    recompute = phases.run(f"{kind_name} recompute", None, prompt_indices=seconds)
    own = phases.run(f"{kind_name} vllm hit", None, vllm_prefix_caching=True, prompt_indices=range(2 * num_pairs))
    with start_daemon() as daemon:
        phases.run(f"{kind_name} store", daemon.address, vllm_prefix_caching=True, prompt_indices=firsts)
        restored = phases.run(f"{kind_name} restored", daemon.address, vllm_prefix_caching=True,
                              prompt_indices=seconds)
    own_hits = {key: [values[i] for i in seconds] for key, values in own.items() if isinstance(values, list)}
    for name, result in (("vllm hit", own_hits), ("restored", restored)):
        assert result["tokens"] == recompute["tokens"], f"{kind_name} {name}: the first tokens differ from recompute"
    assert min(restored["num_cached_tokens"]) > 0, f"{kind_name}: no hit from kvtierd"
    return {"recompute": recompute, "vllm hit": own_hits, "restored": restored}


def kind_row(kind_name: str, measured: dict) -> list[str]:
    cold = statistics.median(measured["recompute"]["ttft_ms"])
    own = statistics.median(measured["vllm hit"]["ttft_ms"])
    ours = statistics.median(measured["restored"]["ttft_ms"])
    hit = statistics.median(measured["restored"]["num_cached_tokens"])
    return [KINDS[kind_name].description, f"{ours:,.1f}", f"{hit:.0f}", f"{cold:,.1f}", f"{own:,.1f}",
            f"{cold / ours:.2f}x", f"{ours / own:.2f}x"]
