"""A POSIX shared-memory segment under /dev/shm, mapped as one flat uint8 tensor.

Not multiprocessing.shared_memory: its resource tracker unlinks segments when an *attaching*
process exits. Here the file is opened by descriptor and mapped through /proc/self/fd, so a
segment replaced or removed between a check and the mapping can never be mapped by mistake
(torch.from_file would otherwise create a missing file).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import weakref

import torch

from kvtierd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

SHM_DIR = "/dev/shm"
SEGMENT_MODE = 0o600
MAX_NAME_CHARS = 200  # below NAME_MAX (255) with room for prefixes
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def default_segment_name(kind: str = "pool") -> str:
    return f"kvtierd-{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def segment_path(name: str) -> str:
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or not _NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"shm segment name {name!r} is invalid: 1-{MAX_NAME_CHARS} characters of "
            "[A-Za-z0-9._-], starting with a letter or digit (no '/')")
    return os.path.join(SHM_DIR, name)


class ShmSegment:
    """`/dev/shm/<name>`: `nbytes` bytes mapped MAP_SHARED as `flat`, a uint8 tensor.

    Invariants: the file is regular, exactly `nbytes` long, mode exactly 0600 (owner read/write,
    whatever the umask), created with O_EXCL so a segment never adopts a file it did not
    create. Memory is reserved at creation (posix_fallocate): a full /dev/shm is a
    ResourceExhausted now, not a SIGBUS on a later write. New segments read as zeros.
    Ownership: the creating process unlinks the segment at `close()`, when the object is
    garbage-collected, or at interpreter exit, whichever comes first (never in a forked child).
    Attachers only drop their mapping. Mappings still open stay valid after the unlink.
    """

    def __init__(self, name: str, flat: torch.Tensor, is_creator: bool) -> None:
        self.name = name
        self.path = segment_path(name)
        self.nbytes = flat.numel()
        self.flat: torch.Tensor | None = flat  # None once closed
        self.is_creator = is_creator
        self._unlinker = weakref.finalize(self, _unlink, self.path, os.getpid()) if is_creator else None

    @classmethod
    def create(cls, nbytes: int, name: str | None = None, what: str = "segment") -> ShmSegment:
        name = default_segment_name() if name is None else name
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, SEGMENT_MODE)
        except FileExistsError:
            raise FailedPrecondition(f"shm segment {path} already exists") from None
        try:
            os.fchmod(fd, SEGMENT_MODE)
            os.ftruncate(fd, nbytes)
            _reserve(fd, nbytes, what)
            flat = _map_fd(fd, path, nbytes)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, flat, is_creator=True)

    @classmethod
    def attach(cls, name: str, nbytes: int) -> ShmSegment:
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise NotFound(f"shm segment {path} does not exist (closed?)") from None
        except PermissionError:
            raise FailedPrecondition(f"shm segment {path} is not readable and writable by "
                                     "this user (mode 0600: attach as the creating user)") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise FailedPrecondition(f"{path} is not a shared-memory segment file")
            if info.st_size != nbytes:
                raise FailedPrecondition(f"shm segment {path} holds {info.st_size} bytes, expected "
                                         f"{nbytes}: stale or foreign segment")
            flat = _map_fd(fd, path, nbytes)
        finally:
            os.close(fd)
        return cls(name, flat, is_creator=False)

    def close(self) -> None:
        self.flat = None  # the mapping goes when the last view of it goes
        if self._unlinker is not None:
            self._unlinker()  # runs at most once


def _map_fd(fd: int, path: str, nbytes: int) -> torch.Tensor:
    """Map exactly the file open as `fd` (shared, read-write)."""
    fd_path = f"/proc/self/fd/{fd}"
    return torch.from_file(fd_path if os.path.exists(fd_path) else path, shared=True, size=nbytes,
                           dtype=torch.uint8)


def _unlink(path: str, creator_pid: int) -> None:
    if os.getpid() != creator_pid:  # a forked child inherits the finalizer; never unlink there
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _reserve(fd: int, nbytes: int, what: str) -> None:
    """Commit tmpfs pages now so that running out of /dev/shm is an error, not a SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            free_bytes = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
            raise ResourceExhausted(
                f"{SHM_DIR} cannot hold a {nbytes}-byte {what} ({free_bytes} bytes free): "
                f"make the {what} smaller or enlarge /dev/shm") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate: sparse, as ftruncate
            raise
