"""The slot files of the SSD tier: where a T2 slot's bytes live and how they move.

One file per configured directory (one per NVMe device, say). Slots are striped across the files
round robin: global slot g lives in file `g % n` while every file still has slots, so consecutive
slots spread over the devices. A slot is `stride` bytes (the block's bytes rounded up to 4096) at
offset `local_slot * stride` in its file.

Files grow as blocks are written, not preallocated: the tier's extent (global slots `[0, E)`) is
what the files hold, and `resize(E)` extends them (posix_fallocate, so a full disk shows at
growth, not at a later write) or truncates them. `capacity_bytes` only bounds the extent; at open
it is itself bounded by what the filesystem can give (free space, beside what the files already
hold, less `index_reserve_bytes` for the index; RLIMIT_FSIZE per file), and a shortfall is
reported in `shortfalls`.

I/O: files are opened with O_DIRECT where the filesystem takes it (checked at open by a probe
read; buffered I/O otherwise, logged once). O_DIRECT wants 4 KiB-aligned addresses
and lengths: a caller's buffer that is aligned and exactly one stride long is handed to the kernel
as is, anything else is staged through a per-thread aligned buffer from an anonymous mmap.
Contiguous slots of one file move with one preadv/pwritev of at most `chunk_blocks` blocks.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import mmap
import os
import resource
import threading
from collections.abc import Sequence

import numpy as np

from kvtierd.t2.ssd_space import SLOT_FILE_NAME
from kvtierd.units import ALIGNMENT_BYTES, round_up

log = logging.getLogger(__name__)

ALIGNMENT = ALIGNMENT_BYTES  # O_DIRECT's; T1's slot stride too, so a read lands in a host slot as is
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# One syscall moves about this much: the nearest whole number of slots (at least one), so that a slot
# a little over 2 MiB (a sealed block's) still moves four at a time, not three.
MAX_CHUNK_BYTES = 8 << 20
PREALLOCATE_CHUNK_BYTES = 256 << 20


def buffer_address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


@dataclasses.dataclass(slots=True)
class SlotFile:
    """One slot file. `num_slots`: the local slots it holds now (its size / stride)."""

    path: str
    fd: int
    o_direct: bool
    num_slots: int


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """Blocks in consecutive slots of one file: `positions[j]` (an index into the caller's list)
    goes to local slot `first_local_slot + j`."""

    file_index: int
    first_local_slot: int
    positions: tuple[int, ...]


class SlotFiles:
    """The slot files of one tier, the slot → (file, offset) map, and batched aligned I/O.

    `max_slots` (the slot map) is fixed at open; `num_slots`, the extent the files hold, changes
    with `resize` (the caller orders it against the slots' use). Thread-safe otherwise: I/O uses
    positional syscalls on fds fixed once a file holds a slot; each thread stages through its own
    aligned buffer.
    """

    def __init__(self, directories: Sequence[str], capacity_bytes: int, slot_nbytes: int, o_direct: bool,
                 index_reserve_bytes: int = 0) -> None:
        self.slot_nbytes = slot_nbytes
        self.stride = round_up(slot_nbytes)
        self.chunk_blocks = max(1, round(MAX_CHUNK_BYTES / self.stride))
        self.shortfalls: list[str] = []  # one line per bound the disk put on the capacity
        self.files: list[SlotFile] = []
        self._staging = threading.local()
        paths = [os.path.join(directory, SLOT_FILE_NAME) for directory in directories]
        for path in paths:
            self.files.append(self._open(path, o_direct))
        total_slots = self._bounded_slots(capacity_bytes, index_reserve_bytes)
        usable = [i for i, f in enumerate(self.files) if f.fd >= 0]
        self._max_of = [0] * len(self.files)
        for j, i in enumerate(usable):
            self._max_of[i] = total_slots // len(usable) + (1 if j < total_slots % len(usable) else 0)
        for i, f in enumerate(self.files):
            f.num_slots = min(f.num_slots, self._max_of[i])
        self._build_slot_map()

    @property
    def max_slots(self) -> int:
        """Slots the files may grow to."""
        return len(self.slot_file)

    @property
    def num_slots(self) -> int:
        """The extent: global slots `[0, num_slots)` are in the files now."""
        return int(sum(f.num_slots for f in self.files))

    def existing_slots(self) -> int:
        """The extent the files held at open: the global slots before the first one a file lacks."""
        extent = self.max_slots
        for index, f in enumerate(self.files):
            if f.num_slots < self._max_of[index]:
                extent = min(extent, int(self._global_of_local[index][f.num_slots]))
        return extent

    @property
    def o_direct(self) -> bool:
        return bool(self.files) and all(f.o_direct for f in self.files)

    def file_bytes(self) -> int:
        """Bytes the files hold (their sizes): the tier's part of the node's disk budget."""
        return self.num_slots * self.stride

    def close(self) -> None:
        for f in self.files:
            if f.fd >= 0:
                os.close(f.fd)
                f.fd = -1

    # --------------------------------------------------------------------------- layout

    def resize(self, num_slots: int) -> None:
        """Make the files hold exactly global slots `[0, num_slots)`: extend them (allocating the
        disk) or truncate them. On a failure (OSError: a full disk) the files are as before."""
        assert 0 <= num_slots <= self.max_slots, (num_slots, self.max_slots)
        counts = np.bincount(self.slot_file[:num_slots], minlength=len(self.files))
        previous = [f.num_slots for f in self.files]
        try:
            for index, f in enumerate(self.files):
                target = int(counts[index])
                if f.fd >= 0 and (target != f.num_slots or os.fstat(f.fd).st_size != target * self.stride):
                    self._set_file_slots(f, target)
        except OSError:
            for f, num in zip(self.files, previous):
                if f.num_slots != num:
                    os.ftruncate(f.fd, num * self.stride)
                    f.num_slots = num
            raise

    def _set_file_slots(self, f: SlotFile, num_slots: int) -> None:
        old, new = f.num_slots * self.stride, num_slots * self.stride
        if new < old or os.fstat(f.fd).st_size > new:
            os.ftruncate(f.fd, new)
        done = old
        while done < new:
            nbytes = min(PREALLOCATE_CHUNK_BYTES, new - done)
            try:
                os.posix_fallocate(f.fd, done, nbytes)
            except OSError:
                os.ftruncate(f.fd, old)
                raise
            done += nbytes
        f.num_slots = num_slots

    def _open(self, path: str, o_direct: bool) -> SlotFile:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        fd, direct = -1, False
        if o_direct and hasattr(os, "O_DIRECT"):
            try:
                fd, direct = os.open(path, flags | os.O_DIRECT, 0o600), True
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                log.warning("SSD tier: %s refuses O_DIRECT (%s); using buffered I/O", path, error)
        try:
            if fd < 0:
                fd = os.open(path, flags, 0o600)
        except OSError as error:
            if error.errno not in DISK_FULL_ERRNOS:
                raise
            self.shortfalls.append(f"disk: cannot create {path} ({error.strerror}); no slots there")
            log.warning("SSD tier: %s", self.shortfalls[-1])
            return SlotFile(path, -1, False, 0)
        slot_file = SlotFile(path, fd, direct, os.fstat(fd).st_size // self.stride)
        if direct and not self._probe_direct(slot_file):
            os.close(fd)
            slot_file.fd, slot_file.o_direct = os.open(path, flags, 0o600), False
        return slot_file

    def _bounded_slots(self, capacity_bytes: int, index_reserve_bytes: int) -> int:
        """`capacity_bytes` in slots, bounded by what the disk can give the files."""
        wanted = capacity_bytes // self.stride
        usable = [f for f in self.files if f.fd >= 0]
        if not usable:
            return 0
        bounds = []
        status = os.fstatvfs(usable[0].fd)
        held = sum(f.num_slots for f in usable) * self.stride
        free = status.f_bavail * status.f_frsize + held - index_reserve_bytes
        if len({os.fstat(f.fd).st_dev for f in usable}) == 1 and free // self.stride < wanted:
            bounds.append((max(0, free) // self.stride, f"{max(0, free):,} bytes free in {usable[0].path}'s "
                                                         "filesystem (less a reserve for the index)"))
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and limit // self.stride * len(usable) < wanted:
            bounds.append((limit // self.stride * len(usable), f"a file size limit RLIMIT_FSIZE={limit:,} bytes"))
        for num_slots, why in sorted(bounds)[:1]:
            line = (f"disk: capacity {wanted * self.stride:,} bytes bounded to {num_slots * self.stride:,} by {why}; "
                    f"{num_slots} of {wanted} slots")
            self.shortfalls.append(line)
            log.warning("SSD tier: %s", line)
            wanted = num_slots
        return wanted

    def _probe_direct(self, slot_file: SlotFile) -> bool:
        """Some filesystems take O_DIRECT at open and refuse it at I/O (EINVAL)."""
        probe = memoryview(mmap.mmap(-1, ALIGNMENT))
        try:
            os.preadv(slot_file.fd, [probe], 0)
            return True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            log.warning("SSD tier: %s refuses O_DIRECT reads (%s); using buffered I/O", slot_file.path, error)
            return False
        finally:
            probe.release()

    def _build_slot_map(self) -> None:
        """Round robin over the files that still have slots: sort (local slot, file) pairs."""
        counts = self._max_of
        file_of = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        local_of = np.concatenate([np.arange(n, dtype=np.int64) for n in counts] or [np.zeros(0, np.int64)])
        order = np.lexsort((file_of, local_of))
        self.slot_file = file_of[order]
        self.slot_local = local_of[order]
        self._global_of_local = [np.zeros(n, dtype=np.int64) for n in counts]  # per file: local → global
        for index, table in enumerate(self._global_of_local):
            mine = self.slot_file == index
            table[self.slot_local[mine]] = np.flatnonzero(mine)

    def global_slot(self, file_index: int, local_slot: int) -> int | None:
        """The global slot of a file's local slot, None if the files do not hold it."""
        if not 0 <= file_index < len(self.files) or not 0 <= local_slot < self.files[file_index].num_slots:
            return None
        return int(self._global_of_local[file_index][local_slot])

    def location(self, slot: int) -> tuple[int, int]:
        return int(self.slot_file[slot]), int(self.slot_local[slot])

    def plan_runs(self, slots: Sequence[int]) -> list[Run]:
        """Group slots (given in the caller's order) into runs of consecutive local slots."""
        order = sorted(range(len(slots)), key=lambda p: (self.slot_file[slots[p]], self.slot_local[slots[p]]))
        runs: list[Run] = []
        start = 0
        for end in range(1, len(order) + 1):
            if end < len(order) and end - start < self.chunk_blocks:
                prev, cur = self.location(slots[order[end - 1]]), self.location(slots[order[end]])
                if cur == (prev[0], prev[1] + 1):
                    continue
            file_index, first_local = self.location(slots[order[start]])
            runs.append(Run(file_index, first_local, tuple(order[start:end])))
            start = end
        return runs

    # --------------------------------------------------------------------------- I/O

    def write_run(self, run: Run, sources: Sequence[memoryview]) -> None:
        """Write `sources[p]` (slot_nbytes each) into the run's slots. Raises OSError."""
        slot_file = self.files[run.file_index]
        staging = self._staging_view()
        iov = []
        for j, position in enumerate(run.positions):
            source = sources[position]
            if self._takes_as_is(slot_file, source):
                iov.append(source)
                continue
            piece = staging[j * self.stride:(j + 1) * self.stride]
            piece[:self.slot_nbytes] = source
            piece[self.slot_nbytes:] = bytes(self.stride - self.slot_nbytes)
            iov.append(piece)
        _pwritev_all(slot_file.fd, iov, run.first_local_slot * self.stride)

    def read_run(self, run: Run, destinations: Sequence[memoryview]) -> list[memoryview | None]:
        """Read the run's slots. Per position: a view of the slot's bytes (the destination itself,
        or this thread's staging buffer, valid until its next call), or None if the file ended
        before the slot did (a short read). Raises OSError."""
        slot_file = self.files[run.file_index]
        staging = self._staging_view()
        iov, views = [], []
        for j, position in enumerate(run.positions):
            destination = destinations[position]
            if self._takes_as_is(slot_file, destination):
                piece = destination
            else:
                piece = staging[j * self.stride:(j + 1) * self.stride]
            iov.append(piece)
            views.append(piece[:self.slot_nbytes])
        nbytes = _preadv_all(slot_file.fd, iov, run.first_local_slot * self.stride)
        num_whole = nbytes // self.stride
        return [view if j < num_whole else None for j, view in enumerate(views)]

    def sync(self, file_indexes: Sequence[int]) -> None:
        for index in sorted(set(file_indexes)):
            os.fdatasync(self.files[index].fd)

    def _takes_as_is(self, slot_file: SlotFile, buffer: memoryview) -> bool:
        if buffer.nbytes != self.stride:
            return False
        return not slot_file.o_direct or buffer_address(buffer) % ALIGNMENT == 0

    def _staging_view(self) -> memoryview:
        view = getattr(self._staging, "view", None)
        if view is None:
            view = self._staging.view = memoryview(mmap.mmap(-1, self.chunk_blocks * self.stride))
        return view


def _pwritev_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    while buffers:
        written = os.pwritev(fd, buffers, offset)
        if written == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        offset += written
        buffers = _advance(buffers, written)


def _preadv_all(fd: int, buffers: list[memoryview], offset: int) -> int:
    """Read until the buffers are full or the file ends; returns the bytes read."""
    total = 0
    while buffers:
        nbytes = os.preadv(fd, buffers, offset)
        if nbytes == 0:
            break
        total += nbytes
        offset += nbytes
        buffers = _advance(buffers, nbytes)
    return total


def _advance(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    """The buffers left after a partial vectored transfer of `nbytes`."""
    while buffers and nbytes >= buffers[0].nbytes:
        nbytes -= buffers[0].nbytes
        buffers = buffers[1:]
    if nbytes:
        buffers = [buffers[0][nbytes:], *buffers[1:]]
    return buffers
