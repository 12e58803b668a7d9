"""A store node's circuit breaker, on a fake clock: opens after exactly max_failures failures in a row,
refuses while open, lets exactly one probe through once open_s has passed, closes on its success and
re-opens on its failure; checked against a small reference model too."""

from __future__ import annotations

import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.t3.circuit_breaker import BreakerState, CircuitBreaker
from tests.factories import FakeClock

OPEN_S = 5.0


def make_breaker(max_failures: int = 3, open_s: float = OPEN_S) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(max_failures, open_s, clock=clock), clock


def opened(max_failures: int = 3) -> tuple[CircuitBreaker, FakeClock]:
    breaker, clock = make_breaker(max_failures)
    for _ in range(max_failures):
        assert breaker.allow()
        breaker.failed()
    assert breaker.state is BreakerState.OPEN
    return breaker, clock


@pytest.mark.parametrize("max_failures", [1, 2, 3, 7])
def test_it_opens_after_exactly_max_failures_failures_in_a_row(max_failures):
    """Closed (every call allowed) through max_failures - 1 failures; open at the max_failures-th."""
    breaker, _ = make_breaker(max_failures)
    for _ in range(max_failures - 1):
        assert breaker.allow()
        breaker.failed()
        assert breaker.state is BreakerState.CLOSED and breaker.num_opened == 0
    assert breaker.allow()
    breaker.failed()
    assert breaker.state is BreakerState.OPEN and breaker.num_opened == 1


def test_a_success_in_between_resets_the_count_of_failures():
    """Failures must be consecutive: max_failures - 1, a success, max_failures - 1 again stays closed."""
    breaker, _ = make_breaker(3)
    for _ in range(4):
        breaker.failed()
        breaker.failed()
        breaker.succeeded()
        assert breaker.state is BreakerState.CLOSED
    breaker.failed()
    breaker.failed()
    assert breaker.state is BreakerState.CLOSED
    breaker.failed()
    assert breaker.state is BreakerState.OPEN


def test_an_open_breaker_refuses_every_call_until_open_s_has_passed():
    """While open, allow() is False, right up to open_s after it opened."""
    breaker, clock = opened()
    for _ in range(10):
        assert not breaker.allow()
    clock.advance(OPEN_S - 0.001)
    assert not breaker.allow() and breaker.state is BreakerState.OPEN


def test_after_open_s_exactly_one_probe_is_let_through():
    """Half-open: the first allow() is the probe; every later one is refused until the probe reports."""
    breaker, clock = opened()
    clock.advance(OPEN_S)
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow()
    assert [breaker.allow() for _ in range(20)] == [False] * 20
    clock.advance(100 * OPEN_S)  # an unanswered probe does not let a second one through
    assert not breaker.allow() and breaker.state is BreakerState.HALF_OPEN


def test_concurrent_callers_in_half_open_get_exactly_one_probe():
    """16 threads calling allow() at once on a half-open breaker: exactly one gets True."""
    for _ in range(20):
        breaker, clock = opened()
        clock.advance(OPEN_S)
        start = threading.Barrier(16)
        answers: list[bool] = []

        def call() -> None:
            start.wait()
            answers.append(breaker.allow())

        threads = [threading.Thread(target=call) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(answers) == 16 and answers.count(True) == 1


def test_a_successful_probe_closes_the_breaker():
    """The probe succeeded: closed, every call allowed, and it takes max_failures new failures to open."""
    breaker, clock = opened(3)
    clock.advance(OPEN_S)
    assert breaker.allow()
    breaker.succeeded()
    assert breaker.state is BreakerState.CLOSED
    assert all(breaker.allow() for _ in range(5))
    breaker.failed()
    breaker.failed()
    assert breaker.state is BreakerState.CLOSED and breaker.num_opened == 1


def test_a_failed_probe_reopens_the_breaker_for_another_open_s():
    """The probe failed at time T: open (refusing) until T + open_s, counted as another opening, then
    one probe again."""
    breaker, clock = opened(3)
    clock.advance(OPEN_S + 2.0)  # the probe goes out later than the earliest moment
    assert breaker.allow()
    breaker.failed()
    assert breaker.state is BreakerState.OPEN and breaker.num_opened == 2
    clock.advance(OPEN_S - 0.001)
    assert not breaker.allow()
    clock.advance(0.001)
    assert breaker.allow() and not breaker.allow()


def test_num_opened_counts_each_opening():
    """Three open → probe-fail → probe-succeed → open cycles: num_opened counts every opening, not failures."""
    breaker, clock = make_breaker(2)
    for cycle in range(3):
        breaker.failed()
        breaker.failed()
        assert breaker.num_opened == 2 * cycle + 1
        clock.advance(OPEN_S)
        assert breaker.allow()
        breaker.failed()  # the probe failed: opened again
        assert breaker.num_opened == 2 * cycle + 2
        clock.advance(OPEN_S)
        assert breaker.allow()
        breaker.succeeded()
        assert breaker.state is BreakerState.CLOSED and breaker.num_opened == 2 * cycle + 2


# ------------------------------------------------------------------------------------------------ the model


class BreakerModel(RuleBasedStateMachine):
    """The breaker against a reference written from the state diagram. Calls follow the store's protocol:
    a call reports success or failure only once allow() let it through; calls may report in any order
    (a call let through while closed may report after the breaker opened)."""

    MAX_FAILURES = 3

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.breaker = CircuitBreaker(self.MAX_FAILURES, OPEN_S, clock=self.clock)
        self.state = "closed"
        self.failures = 0
        self.open_until = 0.0
        self.probe_out = False
        self.num_opened = 0
        self.calls_out = 0  # let through and not reported yet

    def _state_now(self) -> str:
        if self.state == "open" and self.clock.now_s >= self.open_until:
            self.state = "half_open"
        return self.state

    def _open(self) -> None:
        if self.state != "open":
            self.num_opened += 1
        self.state, self.failures, self.probe_out = "open", 0, False
        self.open_until = self.clock.now_s + OPEN_S

    @rule()
    def allow(self) -> None:
        state = self._state_now()
        expected = state == "closed" or (state == "half_open" and not self.probe_out)
        if state == "half_open" and expected:
            self.probe_out = True
        assert self.breaker.allow() is expected
        self.calls_out += expected

    @precondition(lambda self: self.calls_out)
    @rule()
    def a_call_succeeds(self) -> None:
        self.calls_out -= 1
        self.breaker.succeeded()
        self.state, self.failures, self.probe_out = "closed", 0, False

    @precondition(lambda self: self.calls_out)
    @rule()
    def a_call_fails(self) -> None:
        self.calls_out -= 1
        self.breaker.failed()
        state = self._state_now()
        if state == "closed":
            self.failures += 1
            if self.failures == self.MAX_FAILURES:
                self._open()
        else:  # the probe failed (half open), or a late call while open: open for open_s from now
            self._open()

    @rule(seconds=st.sampled_from([0.0, 0.001, 1.0, OPEN_S - 0.001, OPEN_S, 3 * OPEN_S]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def same_state_and_openings(self) -> None:
        assert self.breaker.state.value == self._state_now()
        assert self.breaker.num_opened == self.num_opened


TestBreakerModel = BreakerModel.TestCase
TestBreakerModel.settings = settings(stateful_step_count=40)
