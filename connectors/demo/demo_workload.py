"""The demo's traffic: requests sharing a long system prompt, and multi-turn conversations.

Three phases, in this order, so that every tier gets to serve a hit:
1. "shared": `num_shared_requests` questions after one long system prompt (the first computes
   it, the rest hit it in T0);
2. "chat": `num_conversations` conversations of `num_turns` turns, turns interleaved across
   conversations; each prompt is the whole history (earlier messages and the model's own
   replies) plus a new user message. The conversations together outgrow T0, so a
   conversation's history has moved down to T1 (or T2) by the time its next turn comes;
3. "shared again": new questions after the same system prompt, long since evicted from T0.

What the messages are is a `DemoChat`'s business: `TemplateChat` writes real text
(demo_texts.py) and renders the history through the model's chat template, as a chat server
does each turn; `RandomTokenChat` (for random weights) makes messages of random token ids,
reproducible from the seed, and a prompt is their concatenation.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any, Protocol

from kvtierd.connectors.demo import demo_texts
from kvtierd.connectors.reference.chat_tokenizer import ChatTokenizer
from kvtierd.errors import InvalidArgument


@dataclasses.dataclass(frozen=True, slots=True)
class DemoWorkload:
    """Counts of the traffic; lengths in tokens (the *_tokens lengths shape random-token messages only)."""

    num_conversations: int = 4
    num_turns: int = 3
    num_shared_requests: int = 4  # per shared phase
    reply_tokens: int = 16  # at most, generated per turn
    system_prompt_tokens: int = 1024
    first_turn_tokens: int = 384  # a conversation's opening message
    user_tokens: int = 96  # each later message
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
    conversation: int | None  # the chat phase's conversation index


class DemoChat(Protocol):
    @property
    def stop_token_id(self) -> int | None: ...

    # A message is whatever `prompt` takes a list of: token ids, or a chat template's dict.
    def system(self) -> Any: ...
    def question(self, index: int) -> Any: ...
    def user_message(self, conversation: int, turn: int) -> Any: ...
    def assistant_message(self, token_ids: list[int]) -> Any: ...
    def prompt(self, messages: list) -> list[int]: ...
    def reply_text(self, token_ids: list[int]) -> str: ...


class RandomTokenChat:
    """Messages of random token ids, lengths from the workload; a prompt is their concatenation."""

    stop_token_id = None

    def __init__(self, workload: DemoWorkload) -> None:
        self.workload = workload
        self._rng = random.Random(workload.seed)
        self._system = self._tokens(workload.system_prompt_tokens)

    def _tokens(self, num_tokens: int) -> list[int]:
        return [self._rng.randrange(1, self.workload.vocab_size) for _ in range(num_tokens)]

    def system(self) -> list[int]:
        return self._system

    def question(self, index: int) -> list[int]:
        return self._tokens(self.workload.question_tokens)

    def user_message(self, conversation: int, turn: int) -> list[int]:
        return self._tokens(self.workload.first_turn_tokens if turn == 0 else self.workload.user_tokens)

    def assistant_message(self, token_ids: list[int]) -> list[int]:
        return list(token_ids)

    def prompt(self, messages: list[list[int]]) -> list[int]:
        return [token for message in messages for token in message]

    def reply_text(self, token_ids: list[int]) -> str:
        return ""


class TemplateChat:
    """Real text from demo_texts.py through the model's chat template."""

    def __init__(self, tokenizer: ChatTokenizer, workload: DemoWorkload) -> None:
        num_questions = 2 * workload.num_shared_requests
        if num_questions > len(demo_texts.QUESTIONS) or workload.num_conversations > len(demo_texts.CONVERSATIONS) \
                or workload.num_turns > min(len(c) for c in demo_texts.CONVERSATIONS):
            raise InvalidArgument(f"the chat demo has {len(demo_texts.QUESTIONS) // 2} shared requests per phase, "
                                  f"{len(demo_texts.CONVERSATIONS)} conversations and "
                                  f"{min(len(c) for c in demo_texts.CONVERSATIONS)} turns at most")
        self.tokenizer = tokenizer
        self.stop_token_id = tokenizer.eos_token_id

    def system(self) -> dict[str, str]:
        return {"role": "system", "content": demo_texts.SYSTEM_PROMPT}

    def question(self, index: int) -> dict[str, str]:
        return {"role": "user", "content": demo_texts.QUESTIONS[index]}

    def user_message(self, conversation: int, turn: int) -> dict[str, str]:
        return {"role": "user", "content": demo_texts.CONVERSATIONS[conversation][turn]}

    def assistant_message(self, token_ids: list[int]) -> dict[str, str]:
        return {"role": "assistant", "content": self.reply_text(token_ids)}

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.prompt(messages)

    def reply_text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids).strip()


class DemoTraffic:
    """Yields the turns in order; `reply(turn, tokens)` feeds a chat turn's reply into its history."""

    def __init__(self, workload: DemoWorkload, chat: DemoChat) -> None:
        self.workload = workload
        self.chat = chat
        self._histories: dict[int, list] = {}

    def turns(self) -> Iterator[DemoTurn]:
        w = self.workload
        yield from self._shared("shared", 0)
        for turn in range(w.num_turns):
            for conversation in range(w.num_conversations):
                history = self._histories.setdefault(conversation, [])
                history.append(self.chat.user_message(conversation, turn))
                yield DemoTurn("chat", f"conv {conversation + 1} turn {turn + 1}", f"c{conversation}-t{turn}",
                               self.chat.prompt(history), w.reply_tokens, conversation)
        yield from self._shared("shared again", w.num_shared_requests)

    def _shared(self, phase: str, first: int) -> Iterator[DemoTurn]:
        for i in range(first, first + self.workload.num_shared_requests):
            prompt = self.chat.prompt([self.chat.system(), self.chat.question(i)])
            yield DemoTurn(phase, f"question {i + 1}", f"q{i}", prompt, self.workload.reply_tokens, None)

    def reply(self, turn: DemoTurn, output_token_ids: list[int]) -> None:
        if turn.conversation is not None:
            self._histories[turn.conversation].append(self.chat.assistant_message(output_token_ids))
