"""Small files written so that a crash leaves them whole or absent: written and fsynced, renamed
into place, their directory fsynced."""

from __future__ import annotations

import mmap
import os
import threading


def write_synced(path: str, content: bytes | memoryview | mmap.mmap, mode: int = 0o600) -> None:
    """Create or truncate `path`, write `content`, fsync it (not atomic: see replace_synced)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_synced(path: str, content: bytes, mode: int = 0o600) -> None:
    """Make `path` hold `content` atomically and durably: old content or new after a crash, never part."""
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    write_synced(temporary, content, mode)
    os.replace(temporary, path)
    sync_directory(os.path.dirname(path) or ".")


def sync_directory(directory: str) -> None:
    """fsync a directory: the names created, renamed or removed in it are durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
