"""One daemon per directory: an exclusive flock on `<directory>/kvtierd.lock`, taken at start
before anything in the directory is opened, and held until stop (the SSD tier's directory).

The file holds the holder's pid, for the refusal's message. It is emptied at release, never
removed: removing a lock file races with a daemon that has just opened it. The kernel drops the
lock when its process dies, however it dies, so a file left behind never blocks a start. A
refused daemon changes nothing: it opens the file without truncating it and only reads the pid.
(The SSD tier also locks each layout's subdirectory, t2/ssd_config.py; this lock is the
daemon's, over all of them.)
"""

from __future__ import annotations

import fcntl
import os

from kvtierd.errors import FailedPrecondition

LOCK_FILE_NAME = "kvtierd.lock"


class DirectoryLock:
    """A held lock; `fd` is -1 once released."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def acquire(cls, directory: str, setting: str) -> DirectoryLock:
        """Create `directory` if needed and lock it; FailedPrecondition naming `setting` (and the
        holder's pid) when it cannot be created or another process holds the lock."""
        path = os.path.join(directory, LOCK_FILE_NAME)
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise FailedPrecondition(f"{setting}: cannot create {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FailedPrecondition(f"{setting}: {directory} is in use by another kvtierd (pid {holder}); "
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
