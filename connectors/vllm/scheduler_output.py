"""What the connector's scheduler side reads of vLLM's SchedulerOutput (vllm/v1/core/sched/output.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


def scheduled_requests(scheduler_output: Any) -> Iterator[tuple[str, Sequence[Sequence[int]] | None, bool]]:
    """(request id, new block ids per kv cache group or None, resumed from preemption) of every
    scheduled request. Reads `scheduled_new_reqs[i].req_id / .block_ids` and
    `scheduled_cached_reqs.req_ids / .new_block_ids / .resumed_req_ids` (vllm/v1/core/sched/
    output.py; older releases have `resumed_from_preemption`, a list of bools)."""
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, new.block_ids, False
    cached = scheduler_output.scheduled_cached_reqs
    if cached is None:
        return
    resumed_ids = getattr(cached, "resumed_req_ids", None)
    if resumed_ids is None:
        flags = list(getattr(cached, "resumed_from_preemption", None) or [False] * len(cached.req_ids))
    else:
        flags = [request_id in resumed_ids for request_id in cached.req_ids]
    yield from zip(cached.req_ids, cached.new_block_ids, flags)
