"""How a config section refuses a value: one InvalidArgument naming the key as the daemon's file
spells it (`section.key`), so the words a user sees are the same whichever section checks.

Each section checks itself once, in its own `__post_init__` (beside the tier it configures); the
loader (server/config_loader.py) only converts the file's, the environment's and the flags' text.
"""

from __future__ import annotations

from collections.abc import Collection

from kvtierd.errors import InvalidArgument


def require(ok: object, message: str) -> None:
    """InvalidArgument(message) unless `ok` is true."""
    if not ok:
        raise InvalidArgument(message)


def require_choice(key: str, value: object, allowed: Collection[str]) -> None:
    """InvalidArgument naming `key` and every allowed value unless `value` is one of them."""
    if value not in allowed:
        raise InvalidArgument(f"{key} must be one of {', '.join(allowed)}; got {value!r}")
