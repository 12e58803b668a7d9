"""The demo's traffic: multi-turn conversations, and requests sharing a long system prompt.

Three phases, in this order, so that every tier gets to serve a hit:
1. "shared": `num_shared_requests` questions after one long system prompt (the first computes
   it, the rest hit it in T0);
2. "chat": `num_conversations` conversations of `num_turns` turns, turns interleaved across
   conversations; each prompt is the whole history (earlier prompts and the model's replies)
   plus a new user message. The conversations together outgrow T0, so a conversation's
   history has moved down to T1 (or T2) by the time its next turn comes;
3. "shared again": new questions after the same system prompt, long since evicted from T0.

Token ids are random but reproducible from the seed; the replies are the model's own.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True, slots=True)
class DemoWorkload:
    """Every length in tokens."""

    num_conversations: int = 4
    num_turns: int = 3
    first_turn_tokens: int = 384  # a conversation's opening message
    user_tokens: int = 96  # each later message
    reply_tokens: int = 16  # generated per turn
    num_shared_requests: int = 4  # per shared phase
    system_prompt_tokens: int = 1024
    question_tokens: int = 48
    vocab_size: int = 32000
    seed: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class DemoTurn:
    phase: str  # "shared", "chat" or "shared again"
    label: str  # e.g. "conv 2 turn 3"
    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int


class DemoTraffic:
    """Yields the turns in order; `reply(turn, tokens)` feeds a chat turn's reply into its history."""

    def __init__(self, workload: DemoWorkload) -> None:
        self.workload = workload
        self._rng = random.Random(workload.seed)
        self.system_prompt = self._tokens(workload.system_prompt_tokens)
        self._histories: dict[int, list[int]] = {}

    def _tokens(self, num_tokens: int) -> list[int]:
        return [self._rng.randrange(1, self.workload.vocab_size) for _ in range(num_tokens)]

    def turns(self) -> Iterator[DemoTurn]:
        w = self.workload
        yield from self._shared("shared", 0)
        for turn in range(w.num_turns):
            for conversation in range(w.num_conversations):
                history = self._histories.setdefault(conversation, [])
                history.extend(self._tokens(w.first_turn_tokens if turn == 0 else w.user_tokens))
                yield DemoTurn("chat", f"conv {conversation + 1} turn {turn + 1}", f"c{conversation}-t{turn}",
                               list(history), w.reply_tokens)
        yield from self._shared("shared again", w.num_shared_requests)

    def _shared(self, phase: str, first: int) -> Iterator[DemoTurn]:
        w = self.workload
        for i in range(first, first + w.num_shared_requests):
            yield DemoTurn(phase, f"question {i + 1}", f"q{i}", self.system_prompt + self._tokens(w.question_tokens),
                           w.reply_tokens)

    def reply(self, turn: DemoTurn, output_token_ids: list[int]) -> None:
        if turn.phase == "chat":
            conversation = int(turn.request_id[1:turn.request_id.index("-")])
            self._histories[conversation].extend(output_token_ids)

    def max_prompt_tokens(self) -> int:
        w = self.workload
        chat = w.first_turn_tokens + (w.num_turns - 1) * (w.user_tokens + w.reply_tokens)
        shared = w.system_prompt_tokens + w.question_tokens if w.num_shared_requests else 0
        return max(chat if w.num_conversations else 0, shared)

