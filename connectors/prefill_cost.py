"""An engine's measured cost of computing prompt tokens, which its connector reports to the daemon
(AcquireRequest.recompute_s_per_token) so that lower-tier hits slower to load than to recompute
are left to the engine (kvtierd/tiering/load_decision.py).

A sample is one prefill forward: its seconds over the tokens it computed. Forwards of fewer than
`min_tokens` are not samples: a decode step or a short tail costs mostly its fixed overheads
(weights read, launches), which would make a token look dearer than a prefill's. The figure is
an exponentially weighted moving average (the first sample taken as is), written by the thread
that runs the forwards and read by the one that sends Acquires (a float: read whole).
"""

from __future__ import annotations


class PrefillCost:
    """Seconds per prompt token of this engine's prefill forwards; 0.0 until one was measured."""

    def __init__(self, min_tokens: int, weight: float = 0.2) -> None:
        if min_tokens < 1 or not 0 < weight <= 1:
            raise ValueError(f"need min_tokens >= 1 and 0 < weight <= 1, got {min_tokens}, {weight}")
        self.min_tokens = min_tokens
        self.weight = weight
        self.s_per_token = 0.0  # what the wire carries: 0 = not measured
        self.num_samples = 0

    def observe(self, num_tokens: int, seconds: float) -> bool:
        """A forward computed `num_tokens` prompt tokens in `seconds`; whether it was a sample."""
        if num_tokens < self.min_tokens or seconds <= 0:
            return False
        sample = seconds / num_tokens
        self.s_per_token = sample if self.num_samples == 0 else (
            self.weight * sample + (1 - self.weight) * self.s_per_token)
        self.num_samples += 1
        return True
