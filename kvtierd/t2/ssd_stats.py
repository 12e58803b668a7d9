"""What the SSD tier reports about itself: occupancy, health, admission and I/O totals."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class SsdStats:
    """A consistent snapshot of one SsdTier, taken under its stats lock (SsdTier.stats())."""

    capacity_bytes: int  # the most its slot files may grow to (0 when its index failed to open)
    requested_capacity_bytes: int  # what the config asked for
    used_bytes: int
    num_cached_blocks: int  # ready entries of the index
    num_slots: int
    slot_nbytes: int  # a block's encoded bytes in its slot
    num_evictions: int
    num_quota_skips: int  # stores refused because the owner was at its quota
    num_corrupted_blocks: int  # dropped on read: checksum, key or length mismatch
    num_io_errors: int
    num_recovered_blocks: int  # found intact in the index at open
    num_dropped_on_open: int  # in the index at open but unusable
    admitting: bool  # False after a disk-full or I/O error until the operator fixes it
    reason: str  # why not admitting; "" while admitting
    bytes_written: int
    bytes_read: int
    o_direct: bool
    durability: str  # "fdatasync" or "none"
    file_bytes: int = 0  # its slot files' size now: its take of the node's disk budget (they grow as written)
    share_bytes: int = 0  # its fair share of the node's budget (budget / layouts with T2)
    node_capacity_bytes: int = 0  # the node's disk budget (ssd.capacity_bytes), shared by every layout
    node_used_bytes: int = 0  # what every layout's slot files take of it together
    num_full_skips: int = 0  # blocks not stored: the budget was spent and none of this tier's slots evictable
    num_unauthentic_blocks: int = 0  # sealed records dropped on read: not their key's (moved, altered, forgotten)
    sealed: bool = False  # encryption on: each slot holds its block sealed under its tenant's data key
    num_aged_out_blocks: int = 0  # dropped for being older than retention.max_age_s
