"""The scheduler side of retention hints: a request's hint read once, and the Retain its first step needs.

A request's hint (retention_hints.py) is read when the scheduler side first sees the request; a
malformed one is logged (one warning naming the request and the problem), counted
(`refused_retention_hints`) and dropped: the request is served and stored as if it had none.

A valid hint rides on every StoreSpec of the request (each Commit hints the new blocks it names).
The blocks the daemon held before the request's own stores are named by no Commit: a second turn's
shared prefix (vLLM's own hits, a load from the daemon), and blocks the daemon held but whose load
was declined (vLLM recomputed them; the store's Acquire finds them held and commits nothing). For
those, the request's first step also carries one RetainSpec per request: each full-attention
group's chain from position 0 to the last block the hint covers, sent after that step's stores, so
that it renews every block of the range the daemon holds by then.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvtierd.connectors.vllm.connector_stats import StatsRecorder
from kvtierd.connectors.vllm.metadata import RetainSpec
from kvtierd.connectors.vllm.retention_hints import PromptRetention, RefusedHint, parse_retention

log = logging.getLogger(__name__)


def request_retention(request: Any, stats: StatsRecorder) -> PromptRetention | None:
    """The hint of a vLLM Request (`request.kv_transfer_params`), None without one or when it is refused."""
    try:
        return parse_retention(getattr(request, "kv_transfer_params", None), request.num_prompt_tokens)
    except RefusedHint as refused:
        log.warning("kvtierd connector: request %s: retention hint refused (%s); serving and storing it without "
                    "the hint", request.request_id, refused)
        stats.add("refused_retention_hints", 1)
        return None


def first_step_retain(request_id: str, retention: PromptRetention, full_group_keys: Sequence[Sequence[bytes]],
                      num_held_tokens: int, held_beyond: bool, block_size: int) -> RetainSpec | None:
    """The Retain of a request's first step (None when the daemon can hold none of the range yet).

    `full_group_keys`: each full-attention group's keys by chain position; `num_held_tokens`: the
    tokens vLLM counts as computed before the step (its own hits and the load); `held_beyond`: the
    daemon may hold blocks past those (the lookup declined some)."""
    covered = retention.covered_blocks(block_size)
    if not covered or (covered.start >= num_held_tokens // block_size and not held_beyond):
        return None  # every block of the range the daemon gets comes from this request's hinted Commits
    chains = tuple(tuple(keys[:covered.stop]) for keys in full_group_keys if len(keys) > covered.start)
    return RetainSpec(request_id, retention, chains) if chains else None
