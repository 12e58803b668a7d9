"""A request's retention hint, as a client puts it in vLLM's per-request `kv_transfer_params`.

An agent keeps its session's prompt warm through a tool pause by sending, with its request:

    "kv_transfer_params": {"kvtierd_retention": {"session": "agent-7", "priority": "high",
                                                  "ttl_s": 300, "start_token": 0, "end_token": 1024}}

vLLM passes `kv_transfer_params` through untouched: the OpenAI server's completion and chat
requests put it in `SamplingParams.extra_args["kv_transfer_params"]`
(vllm/entrypoints/openai/*/protocol.py, `to_sampling_params`), and the engine's `Request` reads it
back as `request.kv_transfer_params` (vllm/v1/request.py), which the scheduler side of the connector
sees. Other keys of `kv_transfer_params` are other connectors' business and ignored here.

`session` (1-256 bytes of UTF-8) and `ttl_s` (seconds, > 0) are required; `priority` is "low",
"normal" (the default) or "high"; [`start_token`, `end_token`) are prompt tokens, default the whole
prompt. A malformed hint never fails the request: `parse_retention` raises RefusedHint with the
reason, the scheduler logs it and serves and stores the request without a hint. No vllm and no
grpc here: a PromptRetention travels in the step metadata (metadata.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

PARAMS_KEY = "kvtierd_retention"  # the key of kv_transfer_params this connector reads
PRIORITIES = ("low", "normal", "high")
MAX_SESSION_BYTES = 256  # RetentionHint.retention_session's limit (proto/kvtierd/v1/kvtier.proto)
MAX_TOKEN = 2**32 - 1  # the range's fields are uint32 on the wire
FIELDS = ("session", "priority", "ttl_s", "start_token", "end_token")


class RefusedHint(ValueError):
    """A hint the connector does not send; the message is the reason, one line."""


@dataclasses.dataclass(frozen=True, slots=True)
class PromptRetention:
    """A valid hint: keep the prompt's tokens [start_token, end_token) of session `session` for
    `ttl_s` seconds at `priority`.

    Invariant: 0 <= start_token < end_token <= the prompt's tokens; ttl_s finite and > 0;
    priority one of PRIORITIES; session 1-MAX_SESSION_BYTES bytes of UTF-8."""

    session: str
    priority: str
    ttl_s: float
    start_token: int
    end_token: int

    def __post_init__(self) -> None:
        assert 0 <= self.start_token < self.end_token, self
        assert self.priority in PRIORITIES and self.ttl_s > 0, self

    def covered_blocks(self, block_size: int) -> range:
        """Chain positions of the blocks wholly inside the range."""
        return range(-(-self.start_token // block_size), self.end_token // block_size)


def parse_retention(kv_transfer_params: Any, num_prompt_tokens: int) -> PromptRetention | None:
    """The hint of a request's `kv_transfer_params` (None when it carries none); RefusedHint when malformed."""
    if kv_transfer_params is None or not isinstance(kv_transfer_params, Mapping) or \
            PARAMS_KEY not in kv_transfer_params:
        return None
    hint = kv_transfer_params[PARAMS_KEY]
    if not isinstance(hint, Mapping):
        raise RefusedHint(f"{PARAMS_KEY} must be an object, got {type(hint).__name__}")
    unknown = sorted(str(key) for key in hint if key not in FIELDS)
    if unknown:
        raise RefusedHint(f"unknown field {unknown[0]!r} (known: {', '.join(FIELDS)})")
    session = _session(hint.get("session"))
    priority = hint.get("priority", "normal")
    if not isinstance(priority, str) or priority.lower() not in PRIORITIES:
        raise RefusedHint(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    ttl_s = _ttl_s(hint.get("ttl_s"))
    start_token = _token(hint, "start_token", 0)
    end_token = _token(hint, "end_token", num_prompt_tokens)
    if end_token > num_prompt_tokens:
        raise RefusedHint(f"end_token {end_token} is past the prompt's {num_prompt_tokens} tokens")
    if start_token >= end_token:
        raise RefusedHint(f"start_token {start_token} must be below end_token {end_token}")
    return PromptRetention(session, priority.lower(), ttl_s, start_token, end_token)


def _session(session: Any) -> str:
    if session is None:
        raise RefusedHint("session is required")
    if not isinstance(session, str) or not session:
        raise RefusedHint(f"session must be a non-empty string, got {session!r}")
    try:
        num_bytes = len(session.encode("utf-8"))
    except UnicodeEncodeError:
        raise RefusedHint(f"session must be valid UTF-8, got {session!r}") from None
    if num_bytes > MAX_SESSION_BYTES:
        raise RefusedHint(f"session must be at most {MAX_SESSION_BYTES} bytes of UTF-8, got {num_bytes}")
    return session


def _ttl_s(ttl_s: Any) -> float:
    if ttl_s is None:
        raise RefusedHint("ttl_s is required")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)):
        raise RefusedHint(f"ttl_s must be a number of seconds, got {ttl_s!r}")
    if not math.isfinite(ttl_s) or ttl_s <= 0:
        raise RefusedHint(f"ttl_s must be a finite number of seconds > 0, got {ttl_s!r}")
    return float(ttl_s)


def _token(hint: Mapping, name: str, default: int) -> int:
    value = hint.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RefusedHint(f"{name} must be an integer, got {value!r}")
    if not 0 <= value <= MAX_TOKEN:
        raise RefusedHint(f"{name} must be between 0 and {MAX_TOKEN}, got {value}")
    return value
