"""Reads from below the host tier on their way up to T0: T2 (the SSD) and T3 (the shared store).

Each read runs off the event loop, where it may wait on a disk or the network: a T2 read on a
copy engine host thread, a T3 read on the shared store's reader threads (Tiers.submit_remote_read;
lower_tier_adapters.py starts both). The blocks read land in T1 as well when there is one
(inclusive tiers), and the read leaves `segment.source`, the host rows the T0 upload decodes from:
T1's own slots where T1 took every block in the same codec (the SSD reads into them directly,
O_DIRECT without staging), else a host buffer. A block that did not come back (absent, refused by
its checksum, a failed node) ends the segment there: `source` names only the leading blocks that did.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtierd.index.slot_entry import BlockMeta, StorePlan
from kvtierd.movers.block_codec import BlockCodec
from kvtierd.movers.span_copy import copy_rows
from kvtierd.tiering.layout_tiers import Tiers
from kvtierd.tiering.lower_tier import Segment
from kvtierd.tiering.offload import Offloader
from kvtierd.token_bytes import TokenBytes, packed_size


class LowerReads:
    def __init__(self, tiers: Tiers, offloader: Offloader) -> None:
        self.tiers = tiers
        self.offloader = offloader  # reserves T1 slots (spilling T1's victims by policy)

    def read_t2(self, segment: Segment) -> None:
        """Read the segment's blocks from T2 (verified by the SSD tier) and store them in T1."""
        tiers = self.tiers
        ssd, codec = tiers.ssd, tiers.ssd_codec
        assert ssd is not None and codec is not None, "a T2 read: T2 is on"
        metas = segment.metas
        hashes = [m.block_hash for m in metas]
        plan = self._plan_t1(metas)
        slot_ids = self._direct_slots(plan, metas, codec)
        if slot_ids is not None:
            host = tiers.host
            assert host is not None and plan is not None, "direct slots are T1's, from its plan"
            with tiers.ssd_read.measure(len(metas) * codec.slot_nbytes):
                num_read = ssd.load(hashes, [host.slots[s] for s in slot_ids], parent=metas[0].parent_hash)
            host.index.complete_store(plan.stores[:num_read], success=True)
            host.index.complete_store(plan.stores[num_read:], success=False)
            segment.source = (host.slots, slot_ids[:num_read], host.codec)
        else:
            raw = torch.empty((len(metas), codec.slot_nbytes), dtype=torch.uint8)
            with tiers.ssd_read.measure(raw.numel()):
                num_read = ssd.load(hashes, raw, parent=metas[0].parent_hash)
            segment.source = self._land(metas[:num_read], raw[:num_read], codec, plan)
        if num_read < len(metas):
            tiers.counters.count_failed_loads(len(metas) - num_read)

    def read_t3(self, segment: Segment) -> None:
        """GET the segment's candidates from T3 (each verified, block_frame.py) and store the
        leading run that passed in T1; its metas replace the candidates' (token ids included)."""
        tiers = self.tiers
        candidates = segment.metas
        if not candidates:
            segment.source = (None, [], tiers.remote_codec)
            return
        assert tiers.remote is not None, "a T3 read: T3 is on"
        metas, payloads = tiers.remote.load([m.block_hash for m in candidates], candidates[0].parent_hash,
                                            known_token_bytes(candidates, tiers.layout.block_size),
                                            tiers.layout.block_size)
        segment.metas = metas + candidates[len(metas):]
        segment.source = self.land_t3(metas, payloads)

    def land_t3(self, metas: list[BlockMeta], payloads: list[memoryview]) -> tuple:
        """Store blocks read from T3 (verified `payloads`, in T3's codec) in T1 when there is one;
        the (rows, row ids, codec) an upload decodes them from (T1's slots, or a host buffer)."""
        tiers = self.tiers
        codec = tiers.remote_codec
        assert codec is not None, "blocks read from T3: T3 is on"
        plan = self._plan_t1(metas) if metas else None
        slot_ids = self._direct_slots(plan, metas, codec)
        if slot_ids is not None:  # every block into its own T1 slot: one copy
            host = tiers.host
            assert host is not None and plan is not None, "direct slots are T1's, from its plan"
            for slot, payload in zip(slot_ids, payloads):
                host.slots[slot].numpy()[:] = np.frombuffer(payload, np.uint8)
            host.index.complete_store(plan.stores, success=True)
            return host.slots, slot_ids, host.codec
        raw = torch.empty((len(metas), codec.slot_nbytes), dtype=torch.uint8)
        for row, payload in zip(raw.numpy(), payloads):
            row[:] = np.frombuffer(payload, np.uint8)
        return self._land(metas, raw, codec, plan)

    def _direct_slots(self, plan: StorePlan | None, metas: list[BlockMeta], codec: BlockCodec) -> list[int] | None:
        """The T1 slots to read `metas` straight into: when T1 took every block, in `codec`."""
        host = self.tiers.host
        if plan is None or host is None or len(plan.stores) != len(metas) or host.codec.name != codec.name:
            return None
        return [e.slot for e in plan.stores]

    def _plan_t1(self, metas: list[BlockMeta]) -> StorePlan | None:
        """T1 slots for blocks on their way up (None without T1), T1's victims spilled first."""
        if self.tiers.host is None:
            return None
        plan = self.offloader.prepare_t1_store(metas)
        self.offloader.spill_t1_victims(plan)
        return plan

    def _land(self, metas: list[BlockMeta], rows: torch.Tensor, codec: BlockCodec, plan: StorePlan | None) -> tuple:
        """Store the leading blocks read (`rows`, in `codec`) in T1's reserved slots and give back
        the slots of those that did not come; the (rows, row ids, codec) the upload decodes from."""
        host = self.tiers.host
        if host is None:
            return rows, list(range(len(metas))), codec
        rows = self.tiers.recoded_for_t1(codec, rows)
        row_of = {m.block_hash: i for i, m in enumerate(metas)}
        stored = [e for e in plan.stores if e.block_hash in row_of] if plan is not None else []
        copy_rows(host.slots, [e.slot for e in stored], rows, [row_of[e.block_hash] for e in stored])
        if plan is not None:
            host.index.complete_store(stored, success=True)
            host.index.complete_store([e for e in plan.stores if e.block_hash not in row_of], success=False)
        return rows, list(range(len(metas))), host.codec


def known_token_bytes(metas: list[BlockMeta], block_size: int) -> TokenBytes | None:
    """The blocks' token ids, packed, when the caller sent them for every block (else None)."""
    block_bytes = packed_size(block_size)
    if not all(len(m.token_ids) == block_bytes for m in metas):
        return None
    return TokenBytes(b"".join(m.token_ids for m in metas))
