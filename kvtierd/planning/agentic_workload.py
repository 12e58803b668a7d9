"""A synthetic agentic workload: sessions that share a system prompt and tool schema, grow a
history turn by turn, and pause while a tool runs.

Each turn's prompt is the shared prefix (system prompt + tool schema), the session's whole history
and the turn's new tokens (the last tool result, the user's words): 100-300 tokens a turn by
default. Between two turns the session waits for its tool: a log-normal pause (median 5 s, p90
60 s by default, so a few pauses run for minutes), the pause an LRU cache loses a history in.
Some sessions send retention hints (keep my history for my expected pause), the rest send none:
their hit rate shows whether the hinted ones starve them.

Token ids are random but reproducible from the seed, and a session's turns do not depend on the
order they are scheduled in (one random stream per session), so a replay against a real server
and a simulation see the same prompts. Times are workload seconds; a replay compresses them with
its own time scale.
"""

from __future__ import annotations

import dataclasses
import math
import random

Z_P90 = 1.2815515655446004  # the standard normal's 90th percentile


@dataclasses.dataclass(frozen=True, slots=True)
class AgenticWorkload:
    """The shape of the workload; lengths in tokens, times in workload seconds."""

    num_sessions: int = 48
    num_turns: int = 6
    shared_prefix_tokens: int = 1024  # system prompt + tool schema, the same in every session
    turn_tokens: tuple[int, int] = (100, 300)  # a turn's new tokens, uniform, inclusive
    pause_median_s: float = 5.0  # the tool's run between two turns: log-normal
    pause_p90_s: float = 60.0
    max_pause_s: float = 600.0  # the tail is cut here (a tool that times out)
    arrival_spread_s: float = 60.0  # first turns arrive uniformly over this window
    hinted_fraction: float = 0.75  # sessions that send retention hints; the others send none
    token_id_range: tuple[int, int] = (1000, 40000)  # ordinary vocabulary of the small models used here
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.num_turns < 1:
            raise ValueError("an agentic workload needs at least one session and one turn")
        if not 0 < self.pause_median_s <= self.pause_p90_s:
            raise ValueError(f"pause median {self.pause_median_s} s must be positive and at most its p90 "
                             f"{self.pause_p90_s} s")
        if not 0.0 <= self.hinted_fraction <= 1.0:
            raise ValueError(f"hinted_fraction {self.hinted_fraction} is not in [0, 1]")
        low, high = self.turn_tokens
        if not 0 < low <= high:
            raise ValueError(f"turn_tokens {self.turn_tokens} is not a range of positive lengths")

    @property
    def pause_sigma(self) -> float:
        """The log-normal's sigma: p90 = median * exp(sigma * z90)."""
        return math.log(self.pause_p90_s / self.pause_median_s) / Z_P90


@dataclasses.dataclass(frozen=True, slots=True)
class AgenticTurn:
    """One request of a session: its prompt and the tool pause that follows it."""

    session: int
    turn: int  # 0 = the session's first turn
    prompt_token_ids: tuple[int, ...]
    pause_after_s: float  # workload seconds until the session's next turn; 0 after its last
    hinted: bool  # the session sends retention hints

    @property
    def is_last(self) -> bool:
        return self.pause_after_s == 0.0


class AgenticSessions:
    """Generates every session's turns; a turn's prompt extends the previous turn's prompt."""

    def __init__(self, workload: AgenticWorkload) -> None:
        self.workload = workload
        self.shared_prefix = self._tokens(random.Random(f"{workload.seed}/shared"), workload.shared_prefix_tokens)
        schedule = random.Random(f"{workload.seed}/schedule")
        num_hinted = round(workload.hinted_fraction * workload.num_sessions)
        hinted = set(schedule.sample(range(workload.num_sessions), num_hinted))
        self.arrivals_s = [schedule.uniform(0.0, workload.arrival_spread_s) for _ in range(workload.num_sessions)]
        self.turns = [self._session(session, session in hinted) for session in range(workload.num_sessions)]

    def first_turns(self) -> list[tuple[float, AgenticTurn]]:
        """(arrival in workload seconds, turn) of every session's first turn, earliest first."""
        return sorted(((self.arrivals_s[s], turns[0]) for s, turns in enumerate(self.turns)),
                      key=lambda pair: pair[0])

    def next_turn(self, finished: AgenticTurn) -> AgenticTurn | None:
        """The session's turn after `finished` (sent `finished.pause_after_s` after it ends)."""
        turns = self.turns[finished.session]
        return turns[finished.turn + 1] if finished.turn + 1 < len(turns) else None

    @property
    def num_requests(self) -> int:
        return sum(map(len, self.turns))

    def _session(self, session: int, hinted: bool) -> list[AgenticTurn]:
        workload = self.workload
        rng = random.Random(f"{workload.seed}/session/{session}")
        prompt = list(self.shared_prefix)
        turns: list[AgenticTurn] = []
        for turn in range(workload.num_turns):
            prompt += self._tokens(rng, rng.randint(*workload.turn_tokens))
            last = turn + 1 == workload.num_turns
            pause_s = 0.0 if last else self._pause_s(rng)
            turns.append(AgenticTurn(session, turn, tuple(prompt), pause_s, hinted))
        return turns

    def _pause_s(self, rng: random.Random) -> float:
        workload = self.workload
        pause_s = rng.lognormvariate(math.log(workload.pause_median_s), workload.pause_sigma)
        return min(max(pause_s, 1e-3), workload.max_pause_s)

    def _tokens(self, rng: random.Random, num_tokens: int) -> list[int]:
        low, high = self.workload.token_id_range
        return [rng.randrange(low, high) for _ in range(num_tokens)]
