"""How long vLLM's forward of a prefill step took: the worker's measure of what recomputing a
prompt token costs this engine (connectors/prefill_cost.py), which its Acquires report to the
daemon so that lower-tier hits slower to load than to recompute are left to vLLM.

The bracket is the connector's own calls around the forward (vLLM 0.32,
vllm/v1/worker/kv_connector_model_runner_mixin.py, `_get_kv_connector_output`): the step starts
at `bind_connector_metadata`, before the forward; it ends at `wait_for_save`, after it (after
the draft model's forward too under speculative decoding, `defer_finalize`). On the CPU the
forward has finished when `wait_for_save` is called, so the bracket is two clock readings; on
CUDA it has only been launched, so a pair of timing events is recorded on the current stream at
the two ends and read at a later step, once the second has completed (`query()`: never waited
for).

A step is a sample when it is mostly prefill: at least `min_tokens` of its scheduled tokens
belong to requests still in their prompt (StepMetadata.num_prefill_tokens), and they are at
least half of all its tokens. A step with a synchronous load is no sample (its copies run inside
the bracket). Its cost per token is the bracket's seconds over every token scheduled.
"""

from __future__ import annotations

import collections
import time

import torch

from kvtierd.connectors.prefill_cost import PrefillCost
from kvtierd.connectors.vllm.metadata import StepMetadata

MAX_PENDING_CUDA_STEPS = 8  # bracketed steps whose end event has not completed yet; older ones are dropped


def is_sample(metadata: StepMetadata, min_tokens: int) -> bool:
    """Is the step mostly prefill, with no synchronous load inside its bracket?"""
    num_prefill_tokens = metadata.num_prefill_tokens
    return (num_prefill_tokens >= min_tokens and 2 * num_prefill_tokens >= metadata.num_scheduled_tokens
            and all(spec.is_async for spec in metadata.loads))


class ForwardTimer:
    """Brackets the forwards of prefill steps into `cost`. Called by vLLM's worker thread only.

    Invariants: `_open` is the step being bracketed (its token count and start: a clock reading,
    or a CUDA event) or None; `_pending` holds CUDA brackets whose end has not completed, oldest first."""

    def __init__(self, cost: PrefillCost) -> None:
        self.cost = cost
        self.device: torch.device | None = None  # the engine's (set once its KV caches are registered)
        self._open: tuple[int, float | torch.cuda.Event] | None = None
        self._pending: collections.deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = collections.deque(
            maxlen=MAX_PENDING_CUDA_STEPS)

    @property
    def on_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def step_started(self, metadata: StepMetadata) -> None:
        """vLLM bound this step's metadata: its forward comes next."""
        self._read_completed()
        self._open = None
        if self.device is None or not is_sample(metadata, self.cost.min_tokens):
            return
        if self.on_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._open = (metadata.num_scheduled_tokens, start)
        else:
            self._open = (metadata.num_scheduled_tokens, time.perf_counter())

    def step_ended(self) -> None:
        """vLLM's forward of the step has run (CPU) or been launched (CUDA)."""
        if self._open is None:
            return
        num_tokens, start = self._open
        self._open = None
        if not isinstance(start, torch.cuda.Event):  # a clock reading (CPU)
            self.cost.observe(num_tokens, time.perf_counter() - start)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((num_tokens, start, end))

    def _read_completed(self) -> None:
        """Fold in the CUDA brackets whose end has completed, oldest first."""
        while self._pending and self._pending[0][2].query():
            num_tokens, start, end = self._pending.popleft()
            self.cost.observe(num_tokens, start.elapsed_time(end) / 1e3)
