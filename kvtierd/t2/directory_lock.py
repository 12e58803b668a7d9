"""One holder per directory: an exclusive flock on a lock file in it, taken before anything in the
directory is opened and held until stop. Two hold one: the daemon, on `<ssd.directory>/kvtierd.lock`
from start to stop (server/serve.py), and each layout's SSD tier on its own subdirectory's
`kvtierd-ssd.lock` (ssd_tier.py), so that two tiers never share slot files.

The file holds the holder's pid, for the refusal's message. It is emptied at release, never
removed: removing a lock file races with a process that has just opened it. The kernel drops the
lock when its process dies, however it dies, so a file left behind never blocks a start. A
refused taker changes nothing: it opens the file without truncating it and only reads the pid.
"""

from __future__ import annotations

import fcntl
import os

from kvtierd.errors import FailedPrecondition

LOCK_FILE_NAME = "kvtierd.lock"  # the daemon's
SSD_TIER_LOCK_FILE_NAME = "kvtierd-ssd.lock"  # a layout's SSD tier's


class DirectoryLock:
    """A held lock; `fd` is -1 once released."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def acquire(cls, directory: str, setting: str, file_name: str = LOCK_FILE_NAME,
                holder: str = "another kvtierd") -> DirectoryLock:
        """Create `directory` if needed and lock it; FailedPrecondition naming `setting` (and the
        `holder`'s pid) when it cannot be created or another holder has the lock."""
        path = os.path.join(directory, file_name)
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise FailedPrecondition(f"{setting}: cannot create {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FailedPrecondition(f"{setting}: {directory} is in use by {holder} (pid {pid}); "
                                     "stop it or choose another directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Empty the file and drop the lock. Idempotent."""
        if self.fd < 0:
            return
        os.ftruncate(self.fd, 0)
        os.close(self.fd)
        self.fd = -1
