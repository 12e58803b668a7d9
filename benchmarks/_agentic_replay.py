"""Replays an agentic workload against a `vllm serve`: each session on a thread of its own, its first
turn at its arrival, each next turn when the previous one has finished and its tool pause has passed.

Times are scaled by the replay's time scale (workload seconds x scale = wall seconds). Every turn is a
streaming greedy completion whose prompt is its token ids; the client records when it sent it, when
the first SSE data chunk came (TTFT) and when the stream ended, and the prompt tokens vLLM reports
as cached (`usage.prompt_tokens_details.cached_tokens`, which vLLM 0.32 counts as its own prefix
cache's hits plus the connector's at lookup: `PrefillStats.num_cached_tokens`; the server needs
`--enable-prompt-tokens-details`). A connector hit whose load then fails is recomputed by vLLM but
still counted there: `failed_load_tokens` (from the connector's warning in the server's log, by
the response's id) takes it off. A hinted session's turns carry a kvtierd retention hint over the
whole prompt for the coming pause.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time

from benchmarks._sse_completion import stream_completion_chunks
from kvtierd.planning.agentic_trace import retention_ttl_s
from kvtierd.planning.agentic_workload import AgenticSessions, AgenticTurn
from kvtierd.planning.request_trace import TraceRequest
from tests.connectors.vllm.openai_server import SERVED_NAME

TURN_TIMEOUT_S = 600.0  # one turn on 2 busy cores takes seconds; this only catches a hung server
HINT_PRIORITY = "normal"
HINT_PRIORITY_CODE = 2  # TraceRequest's code for it (retention.hint.Priority)
FAILED_LOAD = re.compile(r"kvtierd connector: (\d+) of \d+ blocks of (\S+) not loaded")


@dataclasses.dataclass(frozen=True, slots=True)
class TurnResult:
    """One request as the client saw it; times in seconds from the replay's start."""

    turn: AgenticTurn
    start_s: float
    end_s: float
    ttft_s: float | None  # None: the turn failed
    cached_tokens: int  # prompt tokens vLLM counted as hits (its prefix cache and kvtierd together)
    hint_ttl_s: float  # the retention hint's ttl_s as sent; 0 = none
    response_id: str = ""  # the completion's id ("cmpl-..."), a prefix of vLLM's request id
    error: str = ""
    failed_load_tokens: int = 0  # of cached_tokens, kvtierd hits whose load failed: recomputed after all

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens vLLM did not compute: its own hits and what kvtierd really loaded."""
        return self.cached_tokens - self.failed_load_tokens

    @property
    def prompt_tokens(self) -> int:
        return len(self.turn.prompt_token_ids)

    def trace_request(self) -> TraceRequest:
        return TraceRequest(self.start_s, self.end_s, self.turn.session, self.turn.turn, self.turn.prompt_token_ids,
                            self.hint_ttl_s, HINT_PRIORITY_CODE)


def retention_params(turn: AgenticTurn, ttl_s: float) -> dict:
    """vLLM's `kv_transfer_params` carrying the kvtierd hint over the turn's whole prompt."""
    return {"kvtierd_retention": {"session": f"agent-{turn.session}", "priority": HINT_PRIORITY, "ttl_s": ttl_s,
                                  "start_token": 0, "end_token": len(turn.prompt_token_ids)}}


def stream_turn(url: str, turn: AgenticTurn, max_tokens: int, ttl_s: float) -> tuple[float, int, str]:
    """(seconds to the first SSE data chunk, cached prompt tokens, the completion's id) of one
    streaming greedy completion."""
    body: dict = {"model": SERVED_NAME, "prompt": list(turn.prompt_token_ids), "max_tokens": max_tokens,
                  "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if ttl_s:
        body["kv_transfer_params"] = retention_params(turn, ttl_s)
    ttft_s, chunks = stream_completion_chunks(url, body, TURN_TIMEOUT_S)
    usage = next((chunk["usage"] for chunk in reversed(chunks) if chunk.get("usage")), None)
    if usage is None:
        raise RuntimeError("the stream ended without usage")
    details = usage.get("prompt_tokens_details")
    if details is None:
        raise RuntimeError("usage without prompt_tokens_details: serve with --enable-prompt-tokens-details")
    response_id = next((chunk["id"] for chunk in chunks if chunk.get("id")), "")
    return ttft_s, int(details["cached_tokens"]), response_id


def failed_load_tokens(server_log: str, block_size: int) -> dict[str, int]:
    """Tokens whose kvtierd load failed, by vLLM request id, from the connector's warnings
    ("kvtierd connector: 11 of 11 blocks of cmpl-... not loaded; vLLM recomputes them")."""
    failed: dict[str, int] = {}
    for match in FAILED_LOAD.finditer(server_log):
        request_id = match.group(2)
        failed[request_id] = failed.get(request_id, 0) + int(match.group(1)) * block_size
    return failed


def with_failed_loads(results: list[TurnResult], failed_by_request: dict[str, int]) -> list[TurnResult]:
    """`results` with each one's failed load tokens (vLLM's request id is the response's id and a suffix)."""
    by_response: dict[str, int] = {}
    for request_id, tokens in failed_by_request.items():
        response_id = request_id.rsplit("-", 2)[0]  # "cmpl-<hex>-<index>-<salt>": one prompt, index 0
        by_response[response_id] = by_response.get(response_id, 0) + tokens
    return [dataclasses.replace(result, failed_load_tokens=by_response.get(result.response_id, 0))
            for result in results]


class Replay:
    """Every session of `sessions` against `url`, hints sent when `send_hints` (hinted sessions only).

    `results` is appended to under `_lock` by the session threads; read it after `run()`.
    """

    def __init__(self, url: str, sessions: AgenticSessions, time_scale: float, max_tokens: int,
                 send_hints: bool) -> None:
        assert time_scale > 0, "a replay needs a positive time scale"
        self.url = url
        self.sessions = sessions
        self.time_scale = time_scale
        self.max_tokens = max_tokens
        self.send_hints = send_hints
        self.results: list[TurnResult] = []
        self._lock = threading.Lock()
        self._start = 0.0

    def run(self) -> float:
        """Replay every session; the wall seconds it took."""
        self._start = time.perf_counter()
        threads = [threading.Thread(target=self._session, args=(arrival_s, turn), name=f"session-{turn.session}")
                   for arrival_s, turn in self.sessions.first_turns()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.results.sort(key=lambda result: result.start_s)
        return time.perf_counter() - self._start

    def _now_s(self) -> float:
        return time.perf_counter() - self._start

    def _session(self, arrival_s: float, first: AgenticTurn) -> None:
        """One session's turns in order; a failed turn ends the session (its history is unknown)."""
        turn: AgenticTurn | None = first
        due_s = arrival_s * self.time_scale
        while turn is not None:
            time.sleep(max(0.0, due_s - self._now_s()))  # the workload's pacing: arrival, then the tool's pause
            result = self._take(turn)
            with self._lock:
                self.results.append(result)
            if result.error:
                return
            due_s = result.end_s + turn.pause_after_s * self.time_scale
            turn = self.sessions.next_turn(turn)

    def _take(self, turn: AgenticTurn) -> TurnResult:
        ttl_s = retention_ttl_s(turn, self.time_scale) if self.send_hints else 0.0
        start_s = self._now_s()
        try:
            ttft_s, cached_tokens, response_id = stream_turn(self.url, turn, self.max_tokens, ttl_s)
        except Exception as error:  # the turn's failure, reported; the other sessions go on
            return TurnResult(turn, start_s, self._now_s(), None, 0, ttl_s, error=f"{type(error).__name__}: {error}")
        return TurnResult(turn, start_s, self._now_s(), ttft_s, cached_tokens, ttl_s, response_id)
