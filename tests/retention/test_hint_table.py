"""The live hints of a layout: effective priority, renewal, release, expiry (lazy and swept)."""

from __future__ import annotations

import pytest

from kvtierd.daemon_key import DaemonKey, TenantTag
from kvtierd.errors import InvalidArgument
from kvtierd.retention.hint import Priority, check_hint
from kvtierd.retention.hint_table import HintTable
from tests.factories import FakeClock

ACME, GLOBEX = TenantTag(b"a" * 16), TenantTag(b"g" * 16)


def key(tag: TenantTag, i: int) -> DaemonKey:
    return DaemonKey(tag + bytes([i]) * 32)


def test_the_effective_priority_is_the_highest_live_hint():
    """Two sessions hint one block: HIGH wins while it lives, then the LOW one is what is left."""
    clock = FakeClock()
    table = HintTable(clock)
    table.set([key(ACME, 1)], "a", Priority.LOW, ttl_s=100)
    table.set([key(ACME, 1)], "b", Priority.HIGH, ttl_s=10)
    assert table.priority(key(ACME, 1)) is Priority.HIGH
    clock.advance(11)
    assert table.priority(key(ACME, 1)) is Priority.LOW  # lazily, before any sweep
    assert table.expire() == 1
    assert table.priority(key(ACME, 1)) is Priority.LOW and len(table) == 1


def test_a_renewed_hint_outlives_its_first_expiry():
    """The same session setting a hint again replaces its priority and TTL; the old expiry forgets nothing."""
    clock = FakeClock()
    table = HintTable(clock)
    table.set([key(ACME, 1)], "s", Priority.LOW, ttl_s=10)
    clock.advance(5)
    table.set([key(ACME, 1)], "s", Priority.NORMAL, ttl_s=10)
    clock.advance(6)
    assert table.expire() == 0
    assert table.priority(key(ACME, 1)) is Priority.NORMAL
    clock.advance(5)
    assert table.expire() == 1 and len(table) == 0


def test_release_drops_only_the_sessions_hints_of_its_tenant():
    """RELEASE without keys drops the session's hints on every block of its tenant, not another tenant's
    session of the same name, and not another session's."""
    table = HintTable(FakeClock())
    changed: list[list[DaemonKey]] = []
    table.add_listener(changed.append)
    table.set([key(ACME, 1), key(ACME, 2)], "s", Priority.HIGH, ttl_s=60)
    table.set([key(ACME, 2)], "t", Priority.LOW, ttl_s=60)
    table.set([key(GLOBEX, 1)], "s", Priority.HIGH, ttl_s=60)
    assert table.release(ACME, "s") == 2
    assert [table.priority(k) for k in (key(ACME, 1), key(ACME, 2), key(GLOBEX, 1))] == \
        [Priority.NONE, Priority.LOW, Priority.HIGH]
    assert sorted(changed[-1]) == [key(ACME, 1), key(ACME, 2)]
    assert table.release(ACME, "t", [key(ACME, 1)]) == 0  # not on that block


@pytest.mark.parametrize("fields, words", [
    (("s", 4, 10.0, 0, 0), "priority"),
    (("s", 1, 0.0, 0, 0), "ttl_s"),
    (("s", 1, float("inf"), 0, 0), "ttl_s"),
    (("s", 1, 3601.0, 0, 0), "max_ttl_s"),
    (("s", 1, 10.0, 0, 65), "past the chain"),
    (("s", 1, 10.0, 16, 16), "start_token"),
    (("", 1, 10.0, 0, 0), "retention_session"),
    (("é" * 129, 1, 10.0, 0, 0), "retention_session"),  # 258 bytes of UTF-8
])
def test_a_bad_hint_names_its_field(fields, words):
    with pytest.raises(InvalidArgument, match=words):
        check_hint(*fields, num_chain_tokens=64, max_ttl_s=3600)


def test_a_hint_covers_the_blocks_wholly_inside_its_range():
    """Tokens [6, 26) of blocks of 4: blocks 2..5 (block 1 starts at 4, block 6 ends at 28)."""
    hint = check_hint("s", 0, 10.0, 6, 26, num_chain_tokens=64, max_ttl_s=3600)
    assert hint.priority is Priority.NORMAL  # unspecified
    assert list(hint.covered_blocks(4)) == [2, 3, 4, 5]
    assert list(check_hint("s", 3, 10.0, 0, 0, 64, 3600).covered_blocks(4)) == list(range(16))
