"""What a restarted SSD tier can trust of its index: the records of its layout, its slot size and
its files, each alone on its slot. No I/O beyond the index scan; the tier applies the result.
"""

from __future__ import annotations

import dataclasses

from kvtierd.daemon_key import DaemonKey
from kvtierd.index.slot_entry import BlockMeta
from kvtierd.sealing.block_seal import BlockSealer
from kvtierd.t2.ssd_files import SlotFiles
from kvtierd.t2.ssd_index import Record, SsdIndex
from kvtierd.token_bytes import TokenBytes


@dataclasses.dataclass(frozen=True, slots=True)
class RecoveredRecords:
    restored: list[tuple[BlockMeta, int, float]]  # (block, global slot, last use): the slot index's restore()
    checksums: dict[int, int]  # global slot -> checksum of its block
    dropped: list[DaemonKey]  # block hashes whose records are to be deleted
    stored_s: dict[DaemonKey, float]  # when each restored block was stored (wall clock)


def recover_records(db: SsdIndex, files: SlotFiles, layout_id: int, slot_nbytes: int,
                    previous_paths: list[str]) -> RecoveredRecords:
    """Keep a record when it is of this layout and slot size, names a file at the same index in
    `previous_paths` (the paths the records were written against) and now, and a slot the files
    hold; two records on one slot are both dropped (neither can be trusted to own it)."""
    paths = [f.path for f in files.files]

    def keep(record: Record) -> bool:
        return (record.layout_id == layout_id and record.length == slot_nbytes
                and record.file_index < min(len(previous_paths), len(paths))
                and previous_paths[record.file_index] == paths[record.file_index]
                and files.global_slot(record.file_index, record.local_slot) is not None)

    records, dropped = db.scan(keep)
    by_slot: dict[int, list[Record]] = {}
    for record in records:
        slot = files.global_slot(record.file_index, record.local_slot)
        assert slot is not None, "keep() took only records on a slot of the files"
        by_slot.setdefault(slot, []).append(record)
    dropped += [r.block_hash for group in by_slot.values() if len(group) > 1 for r in group]
    alone = {slot: group[0] for slot, group in by_slot.items() if len(group) == 1}
    return RecoveredRecords([(BlockMeta(r.block_hash, r.parent_hash, r.token_ids), slot, r.last_use_s)
                             for slot, r in alone.items()],
                            {slot: r.checksum for slot, r in alone.items()}, dropped,
                            {r.block_hash: r.stored_s for r in alone.values()})


def open_sealed_tokens(found: RecoveredRecords, sealer: BlockSealer) -> RecoveredRecords:
    """The records of a sealed tier with their token ids opened; a record whose tokens do not open
    (its tenant forgotten, another master key's data, a damaged record) joins the dropped ones."""
    restored, checksums, dropped = [], {}, list(found.dropped)
    for meta, slot, last_use_s in found.restored:
        token_ids = sealer.open_tokens(meta.block_hash, meta.token_ids)
        if token_ids is None:
            dropped.append(meta.block_hash)
            continue
        restored.append((BlockMeta(meta.block_hash, meta.parent_hash, TokenBytes(token_ids)), slot, last_use_s))
        checksums[slot] = found.checksums[slot]
    return RecoveredRecords(restored, checksums, dropped, found.stored_s)
