"""A request's retention hint in vLLM's kv_transfer_params: every bad form refused with its reason,
good forms read exactly, and the ranges each call carries (a Commit's from its request's first
block, a Retain's from chain position 0)."""

from __future__ import annotations

import pickle

import pytest

from kvtierd.connectors.vllm.metadata import RetainSpec, StepMetadata
from kvtierd.connectors.vllm.retention_calls import hint_over
from kvtierd.connectors.vllm.retention_hints import PromptRetention, RefusedHint, parse_retention
from kvtierd.v1 import kvtier_pb2 as pb

PROMPT_TOKENS = 1000


def params(**hint) -> dict:
    return {"kvtierd_retention": hint}


GOOD = {"session": "agent-7", "ttl_s": 300}


@pytest.mark.parametrize("given, expected", [
    (params(**GOOD), PromptRetention("agent-7", "normal", 300.0, 0, PROMPT_TOKENS)),
    (params(session="agent-7", priority="high", ttl_s=2.5, start_token=64, end_token=512),
     PromptRetention("agent-7", "high", 2.5, 64, 512)),
    (params(session="a", priority="LOW", ttl_s=1, end_token=PROMPT_TOKENS),
     PromptRetention("a", "low", 1.0, 0, PROMPT_TOKENS)),
    ({"do_remote_prefill": False, **params(session="é" * 128, ttl_s=60, start_token=999)},
     PromptRetention("é" * 128, "normal", 60.0, 999, PROMPT_TOKENS)),
])
def test_good_hints_read_exactly(given, expected):
    assert parse_retention(given, PROMPT_TOKENS) == expected


@pytest.mark.parametrize("given", [None, {}, {"do_remote_prefill": True}, "kvtierd_retention", ["kvtierd_retention"]])
def test_requests_without_a_hint_have_none(given):
    assert parse_retention(given, PROMPT_TOKENS) is None


@pytest.mark.parametrize("hint, reason", [
    ("agent-7", "kvtierd_retention must be an object, got str"),
    ({"ttl_s": 300}, "session is required"),
    ({"session": "", "ttl_s": 300}, "session must be a non-empty string, got ''"),
    ({"session": 7, "ttl_s": 300}, "session must be a non-empty string, got 7"),
    ({"session": "x" * 257, "ttl_s": 300}, "session must be at most 256 bytes of UTF-8, got 257"),
    ({"session": "é" * 129, "ttl_s": 300}, "session must be at most 256 bytes of UTF-8, got 258"),
    ({"session": "\ud800", "ttl_s": 300}, "session must be valid UTF-8, got '\\ud800'"),
    ({"session": "a"}, "ttl_s is required"),
    ({"session": "a", "ttl_s": "300"}, "ttl_s must be a number of seconds, got '300'"),
    ({"session": "a", "ttl_s": True}, "ttl_s must be a number of seconds, got True"),
    ({"session": "a", "ttl_s": 0}, "ttl_s must be a finite number of seconds > 0, got 0"),
    ({"session": "a", "ttl_s": -5}, "ttl_s must be a finite number of seconds > 0, got -5"),
    ({"session": "a", "ttl_s": float("inf")}, "ttl_s must be a finite number of seconds > 0, got inf"),
    ({"session": "a", "ttl_s": float("nan")}, "ttl_s must be a finite number of seconds > 0, got nan"),
    ({**GOOD, "priority": "urgent"}, "priority must be one of low, normal, high, got 'urgent'"),
    ({**GOOD, "priority": 3}, "priority must be one of low, normal, high, got 3"),
    ({**GOOD, "start_token": -1}, "start_token must be between 0 and 4294967295, got -1"),
    ({**GOOD, "start_token": 1.5}, "start_token must be an integer, got 1.5"),
    ({**GOOD, "end_token": "all"}, "end_token must be an integer, got 'all'"),
    ({**GOOD, "end_token": False}, "end_token must be an integer, got False"),
    ({**GOOD, "end_token": 2**32}, "end_token must be between 0 and 4294967295, got 4294967296"),
    ({**GOOD, "end_token": PROMPT_TOKENS + 1}, "end_token 1001 is past the prompt's 1000 tokens"),
    ({**GOOD, "start_token": 64, "end_token": 64}, "start_token 64 must be below end_token 64"),
    ({**GOOD, "start_token": PROMPT_TOKENS}, "start_token 1000 must be below end_token 1000"),
    ({**GOOD, "ttl": 300}, "unknown field 'ttl' (known: session, priority, ttl_s, start_token, end_token)"),
])
def test_every_bad_form_is_refused_with_its_reason(hint, reason):
    with pytest.raises(RefusedHint) as refused:
        parse_retention({"kvtierd_retention": hint}, PROMPT_TOKENS)
    assert str(refused.value) == reason


HINT = PromptRetention("agent-7", "high", 300.0, 0, 100)  # blocks of 16: 0-5 covered, 6 (96-112) not


def wire(start: int, end: int, hint: PromptRetention = HINT) -> pb.RetentionHint:
    return pb.RetentionHint(retention_session=hint.session, priority=pb.RetentionHint.HIGH, ttl_s=hint.ttl_s,
                            start_token=start, end_token=end)


def test_a_commits_range_counts_from_its_requests_first_block_and_ends_within_it():
    # The first store: positions 0-7 acquired from the root, all committed.
    assert hint_over(HINT, 16, 0, 8) == wire(0, 100)
    # A later step: the parent at position 3 (held, not named), then 4-7: from token 48, blocks 1-2 covered.
    assert hint_over(HINT, 16, 3, 5, first_named=1) == wire(0, 52)
    # Blocks beyond the range: nothing to hint (never a range that reads, both ends 0, as "every block").
    assert hint_over(HINT, 16, 6, 3, first_named=1) is None
    assert hint_over(HINT, 16, 5, 2, first_named=1) is None  # block 6 is only partly inside
    # A range that starts later: a chain from position 2 covers from its token 16.
    later = PromptRetention("agent-7", "high", 300.0, 50, 100)
    assert hint_over(later, 16, 2, 4, first_named=1) == wire(18, 64, later)
    assert hint_over(later, 16, 0, 3) is None  # blocks 0-2 end at 48: none from 50 on


def test_a_retains_range_counts_from_chain_position_0_and_ends_within_the_chain():
    assert hint_over(HINT, 16, 0, 3) == wire(0, 48)
    assert hint_over(HINT, 16, 0, 10) == wire(0, 100)
    low = PromptRetention("s", "low", 1.0, 16, 40)
    assert hint_over(low, 16, 0, 10) == pb.RetentionHint(retention_session="s", priority=pb.RetentionHint.LOW,
                                                         ttl_s=1.0, start_token=16, end_token=40)
    assert hint_over(PromptRetention("s", "low", 1.0, 20, 47), 16, 0, 10) is None  # no whole block inside


def test_the_hint_crosses_processes_with_the_step_metadata():
    """With TP > 1 vLLM pickles the metadata to every worker process."""
    metadata = StepMetadata(retains=[RetainSpec("r", HINT, ((b"a" * 32, b"b" * 32),))])
    assert pickle.loads(pickle.dumps(metadata)).retains == metadata.retains
