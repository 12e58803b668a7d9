"""An agentic workload as the trace a replay would record, without a server: for `kvtierd simulate`.

Each session sends its first turn at its arrival, and each next turn when the previous one has
finished and its tool pause has passed; a turn takes `latency_s_per_token` per prompt token it
sends (0: done at once). Hinted sessions ask kvtierd to keep their history for the coming pause
(`retention_ttl_s`), the hint a replay against a real server sends too.
"""

from __future__ import annotations

import heapq

from kvtierd.planning.agentic_workload import AgenticSessions, AgenticTurn
from kvtierd.planning.request_trace import TraceRequest

TTL_FACTOR, TTL_MARGIN_S = 1.5, 2.0  # a hint outlives the expected pause by half of it and a margin


def retention_ttl_s(turn: AgenticTurn, time_scale: float = 1.0) -> float:
    """The hint's time to live for `turn` (0 without one): its pause, scaled, with room to spare."""
    if not turn.hinted or turn.is_last:
        return 0.0
    return TTL_FACTOR * turn.pause_after_s * time_scale + TTL_MARGIN_S


def planned_trace(sessions: AgenticSessions, time_scale: float = 1.0,
                  latency_s_per_token: float = 0.0) -> list[TraceRequest]:
    """Every turn of every session with planned times (seconds, scaled by `time_scale`), in send order."""
    pending = [(arrival_s * time_scale, turn.session, turn) for arrival_s, turn in sessions.first_turns()]
    heapq.heapify(pending)
    requests: list[TraceRequest] = []
    while pending:
        start_s, _, turn = heapq.heappop(pending)
        end_s = start_s + latency_s_per_token * len(turn.prompt_token_ids)
        requests.append(TraceRequest(start_s, end_s, turn.session, turn.turn, turn.prompt_token_ids,
                                     retention_ttl_s(turn, time_scale)))
        following = sessions.next_turn(turn)
        if following is not None:
            heapq.heappush(pending, (end_s + turn.pause_after_s * time_scale, following.session, following))
    return requests
