"""A request's retention hint from scheduler to worker to the daemon, against a real `kvtierd serve`
driven in the call order of vLLM engine steps: its stores' Commits carry it over their new blocks,
a second turn's first step renews the blocks held before it with one Retain, a malformed hint is
refused with one warning and counted while the request is stored as without one."""

from __future__ import annotations

import logging

import pytest

from kvtierd.client.sync_client import Session
from kvtierd.connectors.vllm.metadata import RetainSpec
from kvtierd.connectors.vllm.retention_hints import PromptRetention
from kvtierd.errors import InvalidArgument
from kvtierd.launch.daemon_process import DaemonProcess, small_daemon_args, wait_until
from kvtierd.v1 import kvtier_pb2 as pb
from tests.connectors.vllm.retention_support import daemon_answers_retain
from tests.connectors.vllm.vllm_fakes import BLOCK_SIZE, Engine, Request, prompt


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with DaemonProcess(small_daemon_args(str(tmp_path_factory.mktemp("kvtierd")))) as process:
        yield process


@pytest.fixture
def engine(daemon):
    made = Engine(daemon.address)
    yield made
    made.close()


@pytest.fixture
def sent(monkeypatch):
    """The hints the worker's Commits and Retains carry, in call order: ("commit", hint or None, hashes)
    and ("retain", hint, chain); the calls go on to the daemon."""
    calls: list[tuple[str, pb.RetentionHint | None, list[bytes]]] = []
    commit, retain = Session.commit_and_release, Session.retain

    def recording_commit(self, request_id, block_ids, block_hashes, token_ids, parent_hash, retention=None):
        calls.append(("commit", retention, list(block_hashes)))
        return commit(self, request_id, block_ids, block_hashes, token_ids, parent_hash, retention=retention)

    def recording_retain(self, block_hashes, hint, *args, **kwargs):
        calls.append(("retain", hint, list(block_hashes)))
        return retain(self, block_hashes, hint, *args, **kwargs)

    monkeypatch.setattr(Session, "commit_and_release", recording_commit)
    monkeypatch.setattr(Session, "retain", recording_retain)
    return calls


@pytest.fixture
def warnings(caplog, monkeypatch):
    """The connector's warning lines (its loggers may have been told not to propagate to the root's capture)."""
    monkeypatch.setattr(logging.getLogger("kvtierd"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="kvtierd")
    return lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def hinted(**hint) -> dict:
    return {"kvtierd_retention": {"session": "agent-7", "ttl_s": 300, **hint}}


def wire(start: int, end: int, priority=pb.RetentionHint.NORMAL) -> pb.RetentionHint:
    return pb.RetentionHint(retention_session="agent-7", priority=priority, ttl_s=300, start_token=start,
                            end_token=end)


def serve(engine: Engine, request: Request):
    """Prefill `request`, finish it, and wait until its stores and Retains are done."""
    step = engine.prefill(request)
    engine.finish(request, step.engine_block_ids)
    engine.drain()
    engine.worker.worker._executor.submit(lambda: None).result(timeout=30)  # the Retains queued after the stores
    return step


def test_a_first_turns_commit_carries_the_hint_over_its_blocks_and_needs_no_retain(engine, sent):
    a = Request("a", prompt(1, 5 * BLOCK_SIZE + 3), kv_transfer_params=hinted(priority="high"))
    step = serve(engine, a)
    expected = PromptRetention("agent-7", "high", 300.0, 0, 5 * BLOCK_SIZE + 3)
    assert [spec.retention for spec in step.metadata.stores] == [expected]
    assert step.metadata.retains == []  # the daemon held none of it before: its own Commit hints every block
    assert sent == [("commit", wire(0, 5 * BLOCK_SIZE, pb.RetentionHint.HIGH), a.block_hashes[:5])]


def test_a_second_turn_renews_the_shared_prefix_with_one_retain_after_committing_its_tail(engine, sent):
    first = Request("turn-1", prompt(2, 4 * BLOCK_SIZE + 1))
    serve(engine, first)  # stored without a hint
    sent.clear()
    second = Request("turn-2", prompt(3, 6 * BLOCK_SIZE + 2, shared=first.all_token_ids[:4 * BLOCK_SIZE]),
                     kv_transfer_params=hinted(end_token=5 * BLOCK_SIZE + 1))
    step = serve(engine, second)
    assert step.num_external_tokens == 4 * BLOCK_SIZE  # loaded from the daemon
    # Its store: the parent (position 3, held) and the new blocks 4-5; the range from the parent's first token.
    (store,) = step.metadata.stores
    assert store.groups[0].blocks.first_position == 3
    retention = PromptRetention("agent-7", "normal", 300.0, 0, 5 * BLOCK_SIZE + 1)
    assert step.metadata.retains == [RetainSpec("turn-2", retention, (tuple(second.block_hashes[:5]),))]
    assert sent == [("commit", wire(0, 2 * BLOCK_SIZE + 1), second.block_hashes[4:6]),
                    ("retain", wire(0, 5 * BLOCK_SIZE), second.block_hashes[:5])]


def test_a_malformed_hint_is_refused_once_and_the_request_stored_without_it(engine, sent, warnings):
    bad = Request("bad", prompt(4, 3 * BLOCK_SIZE + 1), kv_transfer_params=hinted(ttl_s=-1))
    step = serve(engine, bad)
    assert [spec.retention for spec in step.metadata.stores] == [None]
    assert sent == [("commit", None, bad.block_hashes[:3])]
    refusals = [line for line in warnings() if "retention hint refused" in line]
    assert refusals == ["kvtierd connector: request bad: retention hint refused (ttl_s must be a finite number of "
                        "seconds > 0, got -1); serving and storing it without the hint"]
    assert engine.scheduler.get_kv_connector_stats().data["refused_retention_hints"] == 1
    assert wait_until(lambda: engine.worker.worker.stores.num_stored_blocks == 3)


def test_a_hint_the_daemon_refuses_is_dropped_and_the_blocks_stored_anyway(engine, warnings, monkeypatch):
    """A daemon whose retention.max_ttl_s is below the hint's answers INVALID_ARGUMENT and commits nothing."""
    commit = Session.commit_and_release

    def refusing(self, request_id, block_ids, block_hashes, token_ids, parent_hash, retention=None):
        if retention is not None:  # a bad hint changes nothing
            raise InvalidArgument("ttl_s 300 is above retention.max_ttl_s 60")
        return commit(self, request_id, block_ids, block_hashes, token_ids, parent_hash)

    monkeypatch.setattr(Session, "commit_and_release", refusing)
    request = Request("too-long", prompt(5, 2 * BLOCK_SIZE + 1), kv_transfer_params=hinted())
    serve(engine, request)
    assert engine.worker.worker.stores.num_stored_blocks == 2 and engine.worker.worker.stores.num_dropped_stores == 0
    assert engine.worker.get_kv_connector_stats().data["refused_retention_hints"] == 1
    assert [line for line in warnings() if "refused" in line] == [
        "kvtierd connector: request too-long: kvtierd refused its retention hint (ttl_s 300 is above "
        "retention.max_ttl_s 60); storing it without the hint"]


def test_what_the_daemon_answers_is_counted(daemon, engine):
    """A second turn: its Commit's hint covers the parent and the one new block wholly inside the range,
    its Retain the 5 blocks of the range; the answers add up in the worker's stats."""
    if not daemon_answers_retain(daemon.address):
        pytest.skip("this kvtierd predates retention hints (Retain is UNIMPLEMENTED)")
    first = Request("answered-1", prompt(6, 4 * BLOCK_SIZE + 1))
    serve(engine, first)
    engine.worker.get_kv_connector_stats()
    second = Request("answered-2", prompt(7, 6 * BLOCK_SIZE + 2, shared=first.all_token_ids[:4 * BLOCK_SIZE]),
                     kv_transfer_params=hinted(end_token=5 * BLOCK_SIZE + 1))
    serve(engine, second)
    stats = engine.worker.get_kv_connector_stats().data
    assert (stats.get("retained_blocks"), stats.get("downgraded_retention_blocks", 0)) == (2 + 5, 0)
