"""A retention hint as the core takes it (the wire's RetentionHint, checked), and the blocks of a
chain it covers."""

from __future__ import annotations

import dataclasses
import enum
import math

from kvtierd.errors import InvalidArgument

MAX_SESSION_BYTES = 256


class Priority(enum.IntEnum):
    """A block's retention class in a tier: NONE is evicted first, HIGH last. The values are the
    wire's (RetentionHint.Priority), UNSPECIFIED read as NORMAL."""

    NONE = 0
    LOW = 1
    NORMAL = 2
    HIGH = 3


NUM_CLASSES = len(Priority)


@dataclasses.dataclass(frozen=True, slots=True)
class RetentionHint:
    """A checked hint: `session` 1-256 bytes of UTF-8, `priority` LOW..HIGH, 0 < `ttl_s` <= the
    daemon's max, `start_token` < `end_token` (tokens of the chain the call names)."""

    session: str
    priority: Priority
    ttl_s: float
    start_token: int
    end_token: int

    def covered_blocks(self, block_size: int) -> range:
        """Positions of the chain's blocks lying wholly inside [start_token, end_token)."""
        return range(-(-self.start_token // block_size), self.end_token // block_size)


def check_session(session: str) -> str:
    """A retention session name, or InvalidArgument."""
    if not 1 <= len(session.encode()) <= MAX_SESSION_BYTES:
        raise InvalidArgument(f"retention_session must be 1-{MAX_SESSION_BYTES} bytes, "
                              f"got {len(session.encode())}")
    return session


def check_hint(session: str, priority: int, ttl_s: float, start_token: int, end_token: int, num_chain_tokens: int,
               max_ttl_s: float) -> RetentionHint:
    """The hint of these wire fields over a chain of `num_chain_tokens`, or InvalidArgument
    naming the first bad field. `priority` 0 (unspecified) is NORMAL; both tokens 0 cover the chain."""
    check_session(session)
    if priority not in (0, Priority.LOW, Priority.NORMAL, Priority.HIGH):
        raise InvalidArgument(f"retention priority must be LOW, NORMAL or HIGH, got {priority}")
    if not (math.isfinite(ttl_s) and 0 < ttl_s <= max_ttl_s):
        raise InvalidArgument(f"retention ttl_s must be > 0 and <= {max_ttl_s:g} (retention.max_ttl_s), got {ttl_s:g}")
    if start_token == end_token == 0:
        end_token = num_chain_tokens
    if end_token > num_chain_tokens:
        raise InvalidArgument(f"retention end_token {end_token} is past the chain's {num_chain_tokens} tokens")
    if start_token >= end_token:
        raise InvalidArgument(f"retention start_token {start_token} must be < end_token {end_token}")
    return RetentionHint(session, Priority(priority or Priority.NORMAL), ttl_s, start_token, end_token)
