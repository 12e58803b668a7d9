"""The device pool without CUDA: a POSIX shared-memory segment under /dev/shm.

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

from kvtierd.device_pool import DevicePool, PoolHandle, _check_num_blocks
from kvtierd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvtierd.layout import Layout

SHM_DIR = "/dev/shm"
SEGMENT_MODE = 0o600
MAX_NAME_CHARS = 200  # below NAME_MAX (255) with room for prefixes
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def default_segment_name() -> str:
    return f"kvtierd-{os.getpid()}-{secrets.token_hex(4)}"


def segment_path(name: str) -> str:
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or not _NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"shm segment name {name!r} is invalid: 1-{MAX_NAME_CHARS} characters of "
            "[A-Za-z0-9._-], starting with a letter or digit (no '/')")
    return os.path.join(SHM_DIR, name)


def _map_fd(fd: int, path: str, nbytes: int, layout: Layout, num_blocks: int) -> torch.Tensor:
    """Map exactly the file open as `fd` (shared, read-write) as the block-major pool view."""
    fd_path = f"/proc/self/fd/{fd}"
    flat = torch.from_file(fd_path if os.path.exists(fd_path) else path,
                           shared=True, size=nbytes, dtype=torch.uint8)
    return flat.view(layout.torch_dtype).view(num_blocks, *layout.block_shape)


def _unlink_segment(path: str, creator_pid: int) -> None:
    if os.getpid() != creator_pid:  # a forked child inherits the finalizer; never unlink there
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmDevicePool(DevicePool):
    """The pool in a POSIX shared-memory file, `/dev/shm/<name>`, mapped MAP_SHARED.

    Invariants: the segment is a regular file of exactly `nbytes` bytes, mode exactly 0600
    (owner read/write, whatever the umask), created with O_EXCL so a pool never adopts a file
    it did not create. Memory is reserved at creation (posix_fallocate): a full /dev/shm is a
    ResourceExhausted now, not a SIGBUS on a later write. New segments read as zeros.
    Ownership: the creating process unlinks the segment: at `close()`, at context exit, when
    the pool is garbage-collected, or at interpreter exit, whichever comes first (never in a
    forked child). Attachers only drop their mapping. Unlinking removes the name; mappings
    that are still open (the runner's, or views the caller kept) stay valid until dropped.
    """

    def __init__(self, layout: Layout, num_blocks: int, tensor: torch.Tensor,
                 handle: PoolHandle, is_creator: bool) -> None:
        super().__init__(layout, num_blocks, tensor, handle)
        self.path = segment_path(handle.name)
        self.is_creator = is_creator
        self._unlinker = (weakref.finalize(self, _unlink_segment, self.path, os.getpid())
                          if is_creator else None)

    @classmethod
    def create(cls, layout: Layout, num_blocks: int, name: str | None = None) -> ShmDevicePool:
        num_blocks = _check_num_blocks(num_blocks)
        name = default_segment_name() if name is None else name
        path = segment_path(name)
        nbytes = num_blocks * layout.bytes_per_block
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, SEGMENT_MODE)
        except FileExistsError:
            raise FailedPrecondition(f"shm segment {path} already exists") from None
        try:
            os.fchmod(fd, SEGMENT_MODE)
            os.ftruncate(fd, nbytes)
            _reserve(fd, path, nbytes)
            tensor = _map_fd(fd, path, nbytes, layout, num_blocks)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        handle = PoolHandle("shm", layout, num_blocks, nbytes, name=name)
        return cls(layout, num_blocks, tensor, handle, is_creator=True)

    @classmethod
    def attach(cls, handle: PoolHandle) -> ShmDevicePool:
        if handle.kind != "shm":
            raise InvalidArgument(f"ShmDevicePool cannot attach a {handle.kind!r} handle")
        path = segment_path(handle.name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise NotFound(f"shm segment {path} does not exist (pool closed?)") from None
        except PermissionError:
            raise FailedPrecondition(f"shm segment {path} is not readable and writable by "
                                     "this user (mode 0600: attach as the creating user)") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise FailedPrecondition(f"{path} is not a shared-memory segment file")
            if info.st_size != handle.nbytes:
                raise FailedPrecondition(
                    f"shm segment {path} holds {info.st_size} bytes, the handle says "
                    f"{handle.nbytes} (num_blocks={handle.num_blocks}): stale or foreign segment")
            tensor = _map_fd(fd, path, handle.nbytes, handle.layout, handle.num_blocks)
        finally:
            os.close(fd)
        return cls(handle.layout, handle.num_blocks, tensor, handle, is_creator=False)

    def close(self) -> None:
        self._tensor = None  # the mapping goes when the last view of it goes
        if self._unlinker is not None:
            self._unlinker()  # runs at most once


def _reserve(fd: int, path: str, nbytes: int) -> None:
    """Commit tmpfs pages now so that running out of /dev/shm is an error, not a SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            free_bytes = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
            raise ResourceExhausted(
                f"{SHM_DIR} cannot hold a {nbytes}-byte pool ({free_bytes} bytes free): "
                "lower num_blocks or enlarge /dev/shm") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate: sparse, as ftruncate
            raise
