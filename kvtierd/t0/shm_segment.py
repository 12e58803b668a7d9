"""A POSIX shared-memory segment under /dev/shm, mapped as one flat uint8 tensor.

Not multiprocessing.shared_memory: its resource tracker unlinks segments when an *attaching*
process exits. Here the file is opened by descriptor and mapped through /proc/self/fd, so a
segment replaced or removed between a check and the mapping can never be mapped by mistake
(torch.from_file would otherwise create a missing file).

Another process (another uid, too) maps a segment from a descriptor the creator passed it
(`from_fd`, SCM_RIGHTS over the daemon's fd socket) and never opens the name: the creator keeps
its descriptor open (`fd`) for that. Such a mapping is mmap(2) of the descriptor itself, not of
/proc/self/fd/N: reopening that link checks the file's mode (0600, the creator's uid) again.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import time
import weakref

import numpy as np
import torch

from kvtierd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

log = logging.getLogger(__name__)

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
    The creator holds `fd` (O_RDWR) open until `close()`, to pass it to attachers; attachers hold none.
    """

    def __init__(self, name: str, flat: torch.Tensor, is_creator: bool, fd: int | None = None) -> None:
        self.name = name
        self.path = segment_path(name)
        self.nbytes = flat.numel()
        self.flat: torch.Tensor | None = flat  # None once closed
        self.is_creator = is_creator
        self.fd = fd  # the creator's descriptor, passed to attachers; None for attachers and once closed
        self._unlinker: weakref.finalize | None = None
        if is_creator:
            assert fd is not None, "the creator holds its segment's descriptor"
            self._unlinker = weakref.finalize(self, _unlink, self.path, fd, os.getpid())

    @classmethod
    def create(cls, nbytes: int, name: str | None = None, what: str = "segment", reserve: bool = True) -> ShmSegment:
        """A new segment of `nbytes`, its tmpfs pages committed now (`reserve`), or sparse: then
        `commit` a range before using it and `release` it to give its pages back."""
        name = default_segment_name() if name is None else name
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, SEGMENT_MODE)
        except FileExistsError:
            raise FailedPrecondition(f"shm segment {path} already exists") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while the creator (or an fd it passed) lives: not an orphan
            os.fchmod(fd, SEGMENT_MODE)
            os.ftruncate(fd, nbytes)
            if reserve:
                _reserve(fd, 0, nbytes, what)
            flat = _map_fd(fd, path, nbytes)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        return cls(name, flat, is_creator=True, fd=fd)

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
            _check_segment_file(fd, nbytes, f"shm segment {path}")
            flat = _map_fd(fd, path, nbytes)
        finally:
            os.close(fd)
        return cls(name, flat, is_creator=False)

    @classmethod
    def from_fd(cls, fd: int, nbytes: int, name: str) -> ShmSegment:
        """Map the segment open as `fd` (passed by its creator); `fd` stays the caller's to close.
        The name is the creator's, for messages only: it is never opened."""
        _check_segment_file(fd, nbytes, f"the descriptor passed for shm segment {name}")
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        flat = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))  # keeps the mapping alive
        return cls(name, flat, is_creator=False)

    def commit(self, offset: int, nbytes: int, what: str = "segment") -> None:
        """Commit the tmpfs pages of [offset, offset + nbytes) (creator only): ResourceExhausted when
        /dev/shm cannot hold them, instead of a SIGBUS at the first write."""
        assert self.fd is not None, "the creator commits"
        _reserve(self.fd, offset, nbytes, what)

    def release(self, offset: int, nbytes: int) -> None:
        """Give the pages of [offset, offset + nbytes) back to the system (creator only); they read as
        zeros after (fallocate PUNCH_HOLE, the size kept). Best effort where the kernel lacks it."""
        assert self.fd is not None, "the creator releases"
        if nbytes > 0 and _libc_fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, nbytes) != 0:
            log.warning("giving back %d bytes of %s failed: %s", nbytes, self.path, os.strerror(ctypes.get_errno()))

    def close(self) -> None:
        self.flat = None  # the mapping goes when the last view of it goes
        self.fd = None
        if self._unlinker is not None:
            self._unlinker()  # runs at most once


def _check_segment_file(fd: int, nbytes: int, what: str) -> None:
    """FailedPrecondition unless `fd` is a regular file of exactly `nbytes` bytes."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise FailedPrecondition(f"{what} is not a shared-memory segment file")
    if info.st_size != nbytes:
        raise FailedPrecondition(f"{what} holds {info.st_size} bytes, expected {nbytes}: stale or foreign segment")


def _map_fd(fd: int, path: str, nbytes: int) -> torch.Tensor:
    """Map exactly the file open as `fd` (shared, read-write)."""
    fd_path = f"/proc/self/fd/{fd}"
    return torch.from_file(fd_path if os.path.exists(fd_path) else path, shared=True, size=nbytes,
                           dtype=torch.uint8)


def remove_orphaned_segments(directory: str = SHM_DIR, min_age_s: float = 60.0) -> tuple[int, int]:
    """Unlink the segments that kvtierd processes left when they were killed (SIGKILL, OOM: they
    could not unlink them), and return (how many, their bytes). A segment is an orphan when it is
    this uid's, named kvtierd-*, and nobody holds the shared flock its creator takes for its whole
    life (a descriptor the creator passed to a runner holds it too), so a live daemon's segments
    are never touched, whatever pid namespace it runs in. A segment changed in the last
    `min_age_s` is left alone: its creator may not have taken its lock yet."""
    num_removed = nbytes = 0
    try:
        names = [name for name in os.listdir(directory) if name.startswith("kvtierd-")]
    except OSError:
        return 0, 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode) or \
                    time.time() - info.st_ctime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its creator, or a runner it passed the descriptor to, still holds it
            same = os.lstat(path)
            if (same.st_dev, same.st_ino) == (info.st_dev, info.st_ino):
                os.unlink(path)
                num_removed, nbytes = num_removed + 1, nbytes + info.st_blocks * 512
        except OSError as error:
            log.warning("could not check or remove %s: %s", path, error)
        finally:
            os.close(fd)
    return num_removed, nbytes


def _unlink(path: str, fd: int, creator_pid: int) -> None:
    if os.getpid() != creator_pid:  # a forked child inherits the finalizer; never unlink there
        return
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02  # linux/falloc.h


def _libc_fallocate(fd: int, mode: int, offset: int, nbytes: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return libc.fallocate(fd, mode, offset, nbytes)


def _reserve(fd: int, offset: int, nbytes: int, what: str) -> None:
    """Commit tmpfs pages now so that running out of /dev/shm is an error, not a SIGBUS."""
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            free_bytes = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
            raise ResourceExhausted(
                f"{SHM_DIR} cannot hold a {nbytes}-byte {what} ({free_bytes} bytes free): "
                f"make the {what} smaller or enlarge /dev/shm") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate: sparse, as ftruncate
            raise
