"""The agentic workload: reproducible sessions whose prompts grow, heavy-tailed pauses, a trace file."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from kvtierd.planning.agentic_workload import AgenticSessions, AgenticWorkload
from kvtierd.planning.request_trace import TraceRequest, read_trace, write_trace


def test_each_turn_extends_the_last_by_its_new_tokens_after_the_shared_prefix() -> None:
    """Turn k's prompt is turn k-1's plus 100-300 tokens; every session starts with the same prefix."""
    sessions = AgenticSessions(AgenticWorkload(num_sessions=5, num_turns=4))
    for turns in sessions.turns:
        assert turns[0].prompt_token_ids[:1024] == tuple(sessions.shared_prefix)
        for before, after in zip(turns, turns[1:]):
            assert after.prompt_token_ids[:len(before.prompt_token_ids)] == before.prompt_token_ids
            assert 100 <= len(after.prompt_token_ids) - len(before.prompt_token_ids) <= 300
        assert turns[-1].is_last and not any(turn.is_last for turn in turns[:-1])
    histories = {turns[0].prompt_token_ids[1024:1100] for turns in sessions.turns}
    assert len(histories) == 5, "sessions have histories of their own"


def test_the_same_seed_gives_the_same_sessions_and_another_seed_others() -> None:
    one, same = AgenticSessions(AgenticWorkload(seed=3)), AgenticSessions(AgenticWorkload(seed=3))
    other = AgenticSessions(AgenticWorkload(seed=4))
    assert one.turns == same.turns and one.arrivals_s == same.arrivals_s
    assert one.turns != other.turns


def test_pauses_have_the_asked_median_and_p90() -> None:
    """Log-normal pauses: median ~5 s, p90 ~60 s (within sampling error of 4,000 pauses)."""
    sessions = AgenticSessions(AgenticWorkload(num_sessions=800, num_turns=6, shared_prefix_tokens=1,
                                               turn_tokens=(1, 1), max_pause_s=1e9))
    pauses = sorted(turn.pause_after_s for turns in sessions.turns for turn in turns[:-1])
    assert 4.5 <= statistics.median(pauses) <= 5.5
    assert 50.0 <= pauses[int(0.9 * len(pauses))] <= 72.0


def test_the_hinted_fraction_of_sessions_send_hints() -> None:
    sessions = AgenticSessions(AgenticWorkload(num_sessions=40, hinted_fraction=0.75))
    assert sum(turns[0].hinted for turns in sessions.turns) == 30
    assert all(len({turn.hinted for turn in turns}) == 1 for turns in sessions.turns)


def test_bad_workloads_are_refused() -> None:
    with pytest.raises(ValueError, match="pause median"):
        AgenticWorkload(pause_median_s=10, pause_p90_s=5)
    with pytest.raises(ValueError, match="hinted_fraction"):
        AgenticWorkload(hinted_fraction=1.5)


def test_a_trace_reads_back_in_send_order(tmp_path: Path) -> None:
    requests = [TraceRequest(2.0, 3.5, 1, 0, (5, 6, 7), 4.0), TraceRequest(0.5, 1.0, 0, 0, (5, 6))]
    path = tmp_path / "trace.jsonl"
    assert write_trace(path, requests) == 2
    assert read_trace(path) == sorted(requests, key=lambda r: r.start_s)


def test_a_malformed_trace_line_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(TraceRequest(0, 1, 0, 0, (1,)).to_json() + "\n{\"start_s\": 1}\n")
    with pytest.raises(ValueError, match=r"trace.jsonl:2: not a trace request"):
        read_trace(path)
