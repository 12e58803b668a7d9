"""Random submits and completions of copy jobs on the CPU copy engine, each job blocked on an
event the machine releases (no timing), with the byte budget of copy_engine.py checked after
each step: in-flight bytes within the budget unless one transfer runs alone, a held-back
submit waits only while it does not fit, completion gives its bytes back, and every transfer
completes exactly once with its bytes copied (or its error)."""

from __future__ import annotations

import threading

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.launch.daemon_process import wait_until
from kvtierd.movers.copy_engine import Direction, ThreadCopyEngine

BUDGET = 100
SIZES = [0, 1, 30, 50, 70, 100, 150]  # 150: larger than the budget, runs alone
MAX_OUTSTANDING = 6  # jobs not yet released; the engine has a thread more, so a released job always runs
WAIT_S = 5.0  # bounded waits: a condition not reached by then is a failure


class BlockedCopy:
    """A job that copies `nbytes` once the machine releases it (or raises, if told to fail)."""

    def __init__(self, seed: int, nbytes: int) -> None:
        self.seed, self.nbytes = seed, nbytes
        self.src = torch.full((nbytes,), seed % 251 + 1, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.release = threading.Event()
        self.started = threading.Event()
        self.fail = False
        self.num_runs = 0
        self.transfer = None  # set when submit returns: the budget admitted it
        self.num_completions = 0  # our done callbacks (run after the engine's own release)

    def __call__(self) -> None:
        self.num_runs += 1
        self.started.set()
        assert self.release.wait(3 * WAIT_S), "never released"  # outlasts a failed settle
        if self.fail:
            raise OSError(f"copy {self.seed} failed")
        self.dst.copy_(self.src)

    def on_done(self, transfer) -> None:
        self.num_completions += 1


class CopyEngineBudgetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = ThreadCopyEngine(num_threads=MAX_OUTSTANDING + 1, max_inflight_bytes=BUDGET)
        self.copies: list[BlockedCopy] = []
        self.threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ model

    def admitted(self) -> list[BlockedCopy]:
        """Submitted, let through by the budget, not yet completed."""
        return [c for c in self.copies if c.transfer is not None and not c.num_completions]

    def waiting(self) -> list[BlockedCopy]:
        return [c for c in self.copies if c.transfer is None]

    def inflight_bytes(self) -> int:
        return sum(c.nbytes for c in self.admitted())

    def fits(self, nbytes: int) -> bool:
        """Within the budget, or alone: nothing else in flight, not even a transfer of 0 bytes."""
        return not self.admitted() or self.inflight_bytes() + nbytes <= BUDGET

    def unreleased(self) -> list[BlockedCopy]:
        """The copies the machine has not let go yet (a choice that does not depend on which
        waiting submit won a race for the budget, so hypothesis can replay it)."""
        return [c for c in self.copies if not c.release.is_set()]

    def settled(self) -> bool:
        """Nothing moves until the machine acts: each submit admitted or held back because it
        does not fit, each released and admitted job completed and its bytes given back."""
        return (self.engine.num_waiting_submits == len(self.waiting())
                and not any(c.release.is_set() for c in self.admitted())
                and self.engine.inflight_bytes == self.inflight_bytes()
                and not any(self.fits(c.nbytes) for c in self.waiting()))

    def settle(self) -> None:
        assert wait_until(self.settled, WAIT_S, period_s=0.0005), (
            f"not settled: engine in flight {self.engine.inflight_bytes}, waiting {self.engine.num_waiting_submits}; "
            f"model in flight {self.inflight_bytes()} {[(c.nbytes, c.release.is_set()) for c in self.admitted()]}, "
            f"waiting {[c.nbytes for c in self.waiting()]}")

    # ------------------------------------------------------------------ steps

    @precondition(lambda self: len(self.unreleased()) < MAX_OUTSTANDING)
    @rule(nbytes=st.sampled_from(SIZES))
    def submit(self, nbytes):
        copy = BlockedCopy(len(self.copies), nbytes)
        self.copies.append(copy)

        def submit_and_record():
            transfer = self.engine.submit(Direction.HOST_TO_HOST, copy, nbytes)
            transfer.add_done_callback(copy.on_done)
            copy.transfer = transfer

        thread = threading.Thread(target=submit_and_record, daemon=True)
        self.threads.append(thread)
        thread.start()
        self.settle()

    @precondition(lambda self: self.unreleased())
    @rule(data=st.data(), fail=st.booleans())
    def complete(self, data, fail):
        """Let one job finish (or fail): at once if admitted, else as soon as the budget admits it."""
        unreleased = self.unreleased()
        copy = unreleased[data.draw(st.integers(0, len(unreleased) - 1))]
        copy.fail = fail
        copy.release.set()
        self.settle()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def inflight_bytes_stay_within_the_budget_unless_one_transfer_runs_alone(self):
        assert self.engine.inflight_bytes <= BUDGET or len(self.admitted()) == 1

    @invariant()
    def a_held_back_submit_waits_only_while_it_does_not_fit(self):
        assert self.engine.num_waiting_submits == len(self.waiting())
        assert not any(self.fits(c.nbytes) for c in self.waiting())

    @invariant()
    def every_transfer_completes_once_with_its_bytes_or_its_error(self):
        for copy in self.copies:
            assert copy.num_runs <= 1 and copy.num_completions <= 1
            if copy.transfer is None:
                assert copy.num_runs == 0, "a job ran before the budget admitted it"
                continue
            assert copy.transfer.nbytes == copy.nbytes
            assert copy.num_completions == copy.transfer.done() == copy.release.is_set()
            if copy.num_completions:
                error = copy.transfer.future.exception(0)
                if copy.fail:
                    assert isinstance(error, OSError) and str(error) == f"copy {copy.seed} failed"
                else:
                    assert error is None and torch.equal(copy.dst, copy.src), "the bytes did not land"

    def teardown(self):
        """Release everything: every transfer completes exactly once and the budget is whole."""
        try:
            for copy in self.copies:
                copy.release.set()
            self.settle()
            assert all(c.transfer is not None and c.num_runs == c.num_completions == 1 for c in self.copies)
            assert self.engine.inflight_bytes == 0 and self.engine.num_waiting_submits == 0
        finally:
            for copy in self.copies:
                copy.release.set()
            for thread in self.threads:
                thread.join(WAIT_S)
            self.engine.close()


TestCopyEngineBudget = CopyEngineBudgetMachine.TestCase
TestCopyEngineBudget.settings = settings(stateful_step_count=25)
