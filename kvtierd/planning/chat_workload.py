"""A synthetic multi-turn chat workload: a shared system prompt, many conversations, think times.

Each turn's prompt is the system prompt, the whole history of the conversation and a new user
message; the reply is decoded token by token. Token ids are random but reproducible from the
seed, so two runs with the same settings see the same prompts.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True, slots=True)
class ChatWorkload:
    """The shape of the workload; every length is in tokens, every time in simulated seconds."""

    num_conversations: int = 24
    num_turns: int = 5
    system_prompt_tokens: int = 1024
    user_tokens: tuple[int, int] = (20, 120)  # uniform, inclusive
    reply_tokens: tuple[int, int] = (20, 200)
    think_time_s: tuple[float, float] = (5.0, 90.0)  # between a reply and the next user message
    arrival_spread_s: float = 60.0  # first turns arrive uniformly over this window
    fork_fraction: float = 0.2  # turns sampled with n=2 (copy-on-write on the shared tail block)
    vocab_size: int = 32000
    seed: int = 0


@dataclasses.dataclass(slots=True)
class Turn:
    """One request: the prompt to prefill and the reply(ies) to decode."""

    conversation: int
    turn: int
    prompt: list[int]
    replies: list[list[int]]  # one per sample; replies[0] continues the conversation
    arrival_s: float


class Conversations:
    """Generates turns on demand: a conversation's next turn exists once its last reply is known."""

    def __init__(self, workload: ChatWorkload) -> None:
        self.workload = workload
        # One random stream per conversation: its turns do not depend on scheduling order.
        self._rngs = {c: random.Random(f"{workload.seed}/{c}") for c in range(workload.num_conversations)}
        self.system_prompt = self._tokens(random.Random(f"{workload.seed}/system"), workload.system_prompt_tokens)
        self._history: dict[int, list[int]] = {}

    def _tokens(self, rng: random.Random, num_tokens: int) -> list[int]:
        return [rng.randrange(1, self.workload.vocab_size) for _ in range(num_tokens)]

    def first_turns(self) -> Iterator[Turn]:
        for conversation in range(self.workload.num_conversations):
            self._history[conversation] = list(self.system_prompt)
            arrival_s = self._rngs[conversation].uniform(0, self.workload.arrival_spread_s)
            yield self._turn(conversation, 0, arrival_s)

    def next_turn(self, finished: Turn, now_s: float) -> Turn | None:
        """The follow-up of a finished turn, arriving after a think time; None after the last."""
        history = self._history[finished.conversation]
        history.extend(finished.prompt[len(history):])
        history.extend(finished.replies[0])
        if finished.turn + 1 >= self.workload.num_turns:
            del self._history[finished.conversation]
            return None
        think_s = self._rngs[finished.conversation].uniform(*self.workload.think_time_s)
        return self._turn(finished.conversation, finished.turn + 1, now_s + think_s)

    def _turn(self, conversation: int, turn: int, arrival_s: float) -> Turn:
        rng = self._rngs[conversation]
        prompt = self._history[conversation] + self._tokens(rng, rng.randint(*self.workload.user_tokens))
        num_samples = 2 if rng.random() < self.workload.fork_fraction else 1
        reply_length = rng.randint(*self.workload.reply_tokens)  # n samples share max_tokens
        replies = [self._tokens(rng, reply_length) for _ in range(num_samples)]
        return Turn(conversation, turn, prompt, replies, arrival_s)
