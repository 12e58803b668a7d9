"""The slot files of the SSD tier: where a T2 slot's bytes live and how they move.

One preallocated file per configured directory (one per NVMe device, say). Slots are striped
across the files round robin: global slot g lives in file `g % n` while every file still has
slots, so consecutive slots spread over the devices. A slot is `stride` bytes (the block's bytes
rounded up to 4096) at offset `local_slot * stride` in its file.

I/O: files are opened with O_DIRECT where the filesystem takes it (checked at open by a probe
read; buffered I/O otherwise, logged once). O_DIRECT wants 4 KiB-aligned addresses and lengths:
a caller's buffer that is aligned and exactly one stride long is handed to the kernel as is,
anything else is staged through a per-thread aligned buffer from an anonymous mmap. Contiguous
slots of one file move with one preadv/pwritev of at most `chunk_blocks` blocks.

Preallocation (posix_fallocate) takes what the filesystem gives: when the whole capacity does not
fit (ENOSPC, EDQUOT, EFBIG), the file keeps the slots that did fit and the shortfall is reported.
On a filesystem that ran out of space, the first file (beside the index) gives back
`index_reserve_bytes` (at least, or 1 % of what it got) of the space it gained at this open, so
that the index can still grow; slots it had before are kept.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

from kvtierd.units import ALIGNMENT_BYTES, round_up

log = logging.getLogger(__name__)

ALIGNMENT = ALIGNMENT_BYTES  # O_DIRECT's; T1's slot stride too, so a read lands in a host slot as is
SLOT_FILE_NAME = "kvtierd-slots.bin"
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
MAX_CHUNK_BYTES = 8 << 20  # one syscall moves at most this much (or one block, if larger)
PREALLOCATE_CHUNK_BYTES = 256 << 20


def buffer_address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


@dataclasses.dataclass(slots=True)
class SlotFile:
    """One preallocated file. `fd` and `o_direct` are fixed after open."""

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

    Thread-safe: I/O uses positional syscalls on fds fixed at open; each thread stages through
    its own aligned buffer.
    """

    def __init__(self, directories: Sequence[str], capacity_bytes: int, slot_nbytes: int, o_direct: bool,
                 index_reserve_bytes: int = 0) -> None:
        self.slot_nbytes = slot_nbytes
        self.stride = round_up(slot_nbytes)
        self.chunk_blocks = max(1, MAX_CHUNK_BYTES // self.stride)
        self.shortfalls: list[str] = []  # one line per file that got less than asked
        self.files: list[SlotFile] = []
        self._staging = threading.local()
        total_slots = capacity_bytes // self.stride
        for i, directory in enumerate(directories):
            wanted = total_slots // len(directories) + (1 if i < total_slots % len(directories) else 0)
            reserve = index_reserve_bytes if i == 0 else 0
            self.files.append(self._open(os.path.join(directory, SLOT_FILE_NAME), wanted, o_direct, reserve))
        self._build_slot_map()

    @property
    def num_slots(self) -> int:
        return len(self.slot_file)

    @property
    def o_direct(self) -> bool:
        return bool(self.files) and all(f.o_direct for f in self.files)

    def close(self) -> None:
        for f in self.files:
            if f.fd >= 0:
                os.close(f.fd)
                f.fd = -1

    # --------------------------------------------------------------------------- layout

    def _open(self, path: str, wanted_slots: int, o_direct: bool, reserve_bytes: int) -> SlotFile:
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
            self.shortfalls.append(f"disk: cannot create {path} ({error.strerror}); 0 of {wanted_slots} slots")
            log.warning("SSD tier: %s", self.shortfalls[-1])
            return SlotFile(path, -1, False, 0)
        slot_file = SlotFile(path, fd, direct, 0)
        slot_file.num_slots = self._preallocate(slot_file, wanted_slots, reserve_bytes)
        if direct and slot_file.num_slots and not self._probe_direct(slot_file):
            os.close(fd)
            slot_file.fd, slot_file.o_direct = os.open(path, flags, 0o600), False
        return slot_file

    def _preallocate(self, slot_file: SlotFile, wanted_slots: int, reserve_bytes: int) -> int:
        """Allocate up to `wanted_slots` slots; returns how many the filesystem gave (less the
        reserve, when the filesystem is what ran out)."""
        wanted = wanted_slots * self.stride
        if os.fstat(slot_file.fd).st_size > wanted:
            os.ftruncate(slot_file.fd, wanted)  # capacity was lowered: entries past it are dropped
        had = os.fstat(slot_file.fd).st_size // self.stride * self.stride  # never given back
        done, chunk = 0, max(self.stride, PREALLOCATE_CHUNK_BYTES // self.stride * self.stride)
        failure: OSError | None = None
        while done < wanted:
            nbytes = min(chunk, wanted - done)
            try:
                os.posix_fallocate(slot_file.fd, done, nbytes)
            except OSError as error:
                if error.errno in DISK_FULL_ERRNOS and chunk > self.stride:
                    chunk = max(self.stride, chunk // 2 // self.stride * self.stride)
                    continue
                failure = error
                break
            done += nbytes
        if failure is not None:
            if failure.errno in (errno.ENOSPC, errno.EDQUOT) and reserve_bytes:
                done = max(min(had, done), done - round_up(max(reserve_bytes, done // 100), self.stride))
            if os.fstat(slot_file.fd).st_size > done:
                os.ftruncate(slot_file.fd, done)
            line = (f"disk: preallocated {done:,} of {wanted:,} bytes in {slot_file.path} "
                    f"({failure.strerror or failure}); {done // self.stride} of {wanted_slots} slots")
            self.shortfalls.append(line)
            log.warning("SSD tier: %s", line)
        return done // self.stride

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
        counts = [f.num_slots for f in self.files]
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
