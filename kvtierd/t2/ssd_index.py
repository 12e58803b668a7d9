"""The persistent index of the SSD tier: an LMDB environment in the first tier directory.

Database `entries`: block hash → one record (the format below, version 1): where the bytes are
(file, local slot), how to check them (length, xxh3_64 checksum), what verifies a hit (parent
hash, token ids), which layout wrote them (`layout_id`, xxh3_64 of Layout.fingerprint()) and when
the block was last used (wall-clock seconds, so LRU order survives a restart).
Database `meta`: the slot file paths in order, so a record's file index still names the same file.

Every change is one LMDB transaction: a crash leaves the index before or after it, never between.
The tier orders these transactions against its slot writes (see ssd_tier.py); this module only
encodes, decodes and commits. LMDB serialises write transactions itself; callers that must order
theirs hold their own lock.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Callable, Iterable, Mapping

import lmdb

from kvtierd.daemon_key import DaemonKey
from kvtierd.token_bytes import TokenBytes

INDEX_DIR_NAME = "kvtierd-index.lmdb"
RECORD_VERSION = 2  # 2 adds the time of the store after the head; a version-1 record reads it as its last use
_HEAD = struct.Struct("<BHIIQQdB")  # version, file, local slot, length, checksum, layout id, last use, parent length
_STORED = struct.Struct("<d")  # version 2: wall-clock seconds of the block's store into the tier
_LAST_USE_OFFSET = struct.calcsize("<BHIIQQ")
_FILES_KEY = b"files"


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """One block's index entry, as stored."""

    block_hash: DaemonKey
    file_index: int
    local_slot: int
    length: int
    checksum: int
    layout_id: int
    last_use_s: float
    parent_hash: DaemonKey
    token_ids: TokenBytes
    stored_s: float = 0.0  # wall clock of its store into the tier (retention.max_age_s counts from it)

    def encode(self) -> bytes:
        return (_HEAD.pack(RECORD_VERSION, self.file_index, self.local_slot, self.length, self.checksum,
                           self.layout_id, self.last_use_s, len(self.parent_hash))
                + _STORED.pack(self.stored_s) + self.parent_hash + self.token_ids)

    @classmethod
    def decode(cls, block_hash: DaemonKey, value: bytes) -> Record:
        """Raises ValueError on anything that is not a version-1 or version-2 record."""
        if len(value) < _HEAD.size:
            raise ValueError("record too short")
        version, file_index, local_slot, length, checksum, layout_id, last_use_s, parent_len = _HEAD.unpack_from(value)
        start = _HEAD.size + (_STORED.size if version == 2 else 0)
        if version not in (1, 2) or len(value) < start + parent_len:
            raise ValueError(f"record version {version} or length {len(value)} not understood")
        stored_s = _STORED.unpack_from(value, _HEAD.size)[0] if version == 2 else last_use_s
        parent = DaemonKey(value[start:start + parent_len])
        return cls(block_hash, file_index, local_slot, length, checksum, layout_id, last_use_s,
                   parent, TokenBytes(value[start + parent_len:]), stored_s)


class SsdIndex:
    """LMDB environment with the `entries` and `meta` databases. Thread-safe (LMDB's own
    writer lock; no read transactions outlive a call)."""

    def __init__(self, directory: str, map_bytes: int, durable: bool) -> None:
        path = os.path.join(directory, INDEX_DIR_NAME)
        # sync/metasync: with durable=False a commit survives a process crash (the page cache
        # holds it) but not a power loss; slot checksums still catch any mismatch.
        self._env = lmdb.open(path, map_size=map_bytes, max_dbs=2, sync=durable, metasync=durable,
                              readahead=False, max_readers=16)
        self._entries = self._env.open_db(b"entries")
        self._meta = self._env.open_db(b"meta")

    def scan(self, keep: Callable[[Record], bool]) -> tuple[list[Record], list[DaemonKey]]:
        """Read every record. Returns (records `keep` accepts, keys of the others, including
        those that do not decode). Changes nothing: the caller deletes what it drops."""
        kept: list[Record] = []
        dropped: list[DaemonKey] = []
        with self._env.begin(db=self._entries) as txn:
            for stored_key, value in txn.cursor():
                key = DaemonKey(bytes(stored_key))  # the daemon wrote every key: a DaemonKey
                try:
                    record = Record.decode(key, bytes(value))
                except ValueError:
                    dropped.append(key)
                    continue
                if keep(record):
                    kept.append(record)
                else:
                    dropped.append(record.block_hash)
        return kept, dropped

    def files(self) -> list[str] | None:
        """The slot file paths the records' file indexes refer to (None before the first open)."""
        with self._env.begin(db=self._meta) as txn:
            value = txn.get(_FILES_KEY)
        return None if value is None else bytes(value).decode().split("\0")

    def set_files(self, paths: list[str]) -> None:
        with self._env.begin(write=True, db=self._meta) as txn:
            txn.put(_FILES_KEY, "\0".join(paths).encode())

    def commit(self, deletes: Iterable[DaemonKey] = (), puts: Iterable[Record] = (),
               last_uses: Mapping[DaemonKey, float] | None = None) -> None:
        """One transaction: delete, insert, then refresh the last use of records still present.
        Raises lmdb.Error (DiskError on a full disk, MapFullError when the map is full)."""
        with self._env.begin(write=True, db=self._entries) as txn:
            for key in deletes:
                txn.delete(key)
            for record in puts:
                txn.put(record.block_hash, record.encode())
            for key, last_use_s in (last_uses or {}).items():
                value = txn.get(key)
                if value is not None and len(value) >= _HEAD.size:
                    value = bytearray(value)
                    struct.pack_into("<d", value, _LAST_USE_OFFSET, last_use_s)
                    txn.put(key, bytes(value))

    def sync(self) -> None:
        self._env.sync(True)

    def close(self) -> None:
        self._env.close()
