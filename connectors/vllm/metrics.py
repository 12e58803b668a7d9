"""What vLLM's own metrics say about kvtierd: cached prompt tokens per source, decode latency.

Read inside the engine's process, from an `LLM` built with `disable_log_stats=False`.
`vllm:prompt_tokens_cached_by_source` is the Prometheus counter a `vllm serve` exports too: the
scheduler records, per newly scheduled request, the connector's hit split by
`get_external_cache_hit_sources` (vllm/v1/core/sched/scheduler.py; vllm/v1/metrics/loggers.py).
kvtierd's tiers show as vLLM's sources: T0 "device", T1 "host", T2 "disk" (with vLLM's prefix cache
on, "device" also counts vLLM's own hits); the connector's own `vllm:kvtierd_loaded_tokens{tier}`
counts only what kvtierd loaded, with it on or off; `vllm:kvtierd_declined_slow_tokens{tier}`
counts the tokens it held but left to vLLM, their load being expected slower than recomputing them.
"""

from __future__ import annotations

from typing import Any

CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
TIER_OF_SOURCE = {"device": "T0", "host": "T1", "disk": "T2"}
LOADED_TOKENS = "vllm:kvtierd_loaded_tokens"
DECLINED_TOKENS = "vllm:kvtierd_declined_slow_tokens"
FAILED_LOAD_BLOCKS = "vllm:kvtierd_failed_load_blocks"


def counter_by_label(llm: Any, name: str, label: str) -> dict[str, int]:
    """A counter's totals so far by one label's values (summed over engines), non-zero only."""
    totals: dict[str, int] = {}
    for metric in llm.get_metrics():
        if metric.name == name:
            value = metric.labels[label]
            totals[value] = totals.get(value, 0) + int(metric.value)
    return {value: n for value, n in totals.items() if n}


def cached_tokens_by_source(llm: Any) -> dict[str, int]:
    """Cached prompt tokens so far, by vLLM's source label (summed over engines), non-zero only."""
    return counter_by_label(llm, CACHED_BY_SOURCE, "source")


def loaded_tokens_by_tier(llm: Any) -> dict[str, int]:
    """The connector's own count (connector_stats.py) of the prompt tokens it loaded, by daemon tier."""
    return counter_by_label(llm, LOADED_TOKENS, "tier")


def declined_tokens_by_tier(llm: Any) -> dict[str, int]:
    """The connector's count of the prompt tokens the daemon held but declined as slower than recompute, by tier."""
    return counter_by_label(llm, DECLINED_TOKENS, "tier")


def counter_total(llm: Any, name: str) -> int:
    """A counter's total so far, summed over its label sets (engines)."""
    return int(sum(metric.value for metric in llm.get_metrics() if metric.name == name))


def difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Per-source growth of a counter snapshot (what the requests in between added)."""
    return {source: n - before.get(source, 0) for source, n in after.items() if n != before.get(source, 0)}


def decode_itl_ms(output: Any) -> float | None:
    """A finished RequestOutput's mean inter-token latency, from the engine core's own timestamps
    (first to last token, so prefill is excluded); None with fewer than two tokens or no stats."""
    stats = getattr(output, "metrics", None)
    num_tokens = getattr(stats, "num_generation_tokens", 0)
    if stats is None or num_tokens < 2:
        return None
    return (stats.last_token_ts - stats.first_token_ts) / (num_tokens - 1) * 1e3
