"""The tiers of one namespace and what the movers share: the copy engine, the mover and
finalizer threads, the write-backs in flight, measured bandwidths and counters.

The copy engine is the device's, shared with the other layouts on it (movers/factory.py): its
bandwidth estimates are the device's, but the bytes a layout's copies move are counted here, per
layout (`submit`, `run`), so the layouts' figures add up to the node's.

Threads, and what may wait where: the event loop and the block index lock never wait on a
copy or a disk. Work that submits copies (the engine's submit waits while its byte budget is
spent) or waits for them — eviction write-back, write-through, promotion — is handed to the
mover threads (`dispatch`); T2 writes of T1's victims run on the spill thread (a slow disk
delays only them); T0 → T1 write-through reserves its T1 slots on the write-through thread, which
may wait there for T1 to have room (write_through.py) without holding up a mover. Finalizers
(index updates after a copy landed) run on one dedicated thread, never on a copy thread: a copy
thread only copies.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvtierd.index.block_index import BlockIndex
from kvtierd.layout import Layout
from kvtierd.movers.block_codec import BlockCodec, make_codec
from kvtierd.movers.copy_engine import Bandwidth, CopyEngine, Direction, Job, Transfer
from kvtierd.retention.hint_table import HintTable
from kvtierd.t0.device_pool import DevicePool
from kvtierd.t1.host_tier import HostTier
from kvtierd.tiering.recompute_cost import RecomputeCost
from kvtierd.tiering.tier_config import TierConfig
from kvtierd.tiering.tier_counters import TierCounters
from kvtierd.tiering.write_backs import WriteBacks

if TYPE_CHECKING:  # imported where a tier is built (tier_manager.py): lmdb and redis load only when used
    from kvtierd.t2.ssd_tier import SsdTier
    from kvtierd.t3.remote_tier import RemoteTier

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Tiers:
    """T0 (index + pool), T1 (host), T2 (ssd, optional), T3 (the shared store, optional), and the
    means to move bytes."""

    layout: Layout
    index: BlockIndex
    pool: DevicePool
    host: HostTier | None
    ssd: SsdTier | None
    engine: CopyEngine
    config: TierConfig
    ssd_codec: BlockCodec | None = None
    remote: RemoteTier | None = None
    remote_codec: BlockCodec | None = None
    ssd_read: Bandwidth = dataclasses.field(default_factory=lambda: Bandwidth(2e9))
    ssd_write: Bandwidth = dataclasses.field(default_factory=lambda: Bandwidth(1e9))
    counters: TierCounters = dataclasses.field(default_factory=TierCounters)
    finalizer: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-finalize"))
    movers: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvtierd-mover"))
    spiller: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-spill"))
    through: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtierd-through"))
    write_backs: WriteBacks = dataclasses.field(default_factory=WriteBacks)
    hints: HintTable = dataclasses.field(default_factory=HintTable)  # the layout's live retention hints
    # what a lower-tier hit must beat to be loaded: the config's override, else the engines' reports
    recompute: RecomputeCost = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.recompute = RecomputeCost(self.config.recompute_s_per_token)
        if self.ssd is not None and self.ssd_codec is None:
            self.ssd_codec = make_codec(self.config.ssd_codec, self.layout)
        if self.remote is not None and self.remote_codec is None:
            self.remote_codec = make_codec(self.config.remote_codec, self.layout)
        self._num_unfinished = 0  # finalizers (`after`) and moves (`dispatch`) that have not returned
        self._unfinished = threading.Condition()

    def submit(self, direction: Direction, job: Job, nbytes: int) -> Transfer:
        """Submit a copy of this layout's blocks to the device's engine (blocks while its budget
        is spent); its bytes count in this layout's `bytes_moved` once it landed."""
        return self.engine.submit(direction, job, nbytes, on_landed=self._count_moved)

    def submit_remote_read(self, job: Callable[[], None], nbytes: int) -> Transfer:
        """Run a T3 read (`job`: into host memory) on the shared store's reader threads, not the
        copy engine's; its bytes count as host-to-host moves once it returned."""
        transfer = Transfer(Direction.HOST_TO_HOST, nbytes)

        def run() -> None:
            try:
                job()
            except BaseException as error:
                transfer.future.set_exception(error)
            else:
                self._count_moved(transfer)
                transfer.future.set_result(None)

        assert self.remote is not None, "a T3 read: T3 is on"
        self.remote.readers.submit(run)
        return transfer

    def run(self, direction: Direction, job: Job, nbytes: int) -> None:
        """`submit` and wait: for copies that must land before the caller goes on."""
        self.submit(direction, job, nbytes).wait()

    def _count_moved(self, transfer: Transfer) -> None:
        self.counters.count_moved(transfer.direction, transfer.nbytes)

    def after(self, transfer: Transfer, finalize: Callable[[BaseException | None], None]) -> None:
        """Run `finalize(error)` on the finalizer thread once `transfer` has landed or failed."""
        with self._unfinished:
            self._num_unfinished += 1

        def run(error: BaseException | None) -> None:
            try:
                _logged(finalize, error)
            finally:
                with self._unfinished:
                    self._num_unfinished -= 1
                    self._unfinished.notify_all()

        def finalize_later(done: Transfer) -> None:
            self.finalizer.submit(run, done.future.exception())

        transfer.add_done_callback(finalize_later)

    def dispatch(self, work: Callable[[], None], executor: concurrent.futures.Executor | None = None) -> None:
        """Run `work()` on a mover thread (or `executor`), counted until it returns (wait_quiet).
        Never blocks: the caller may be the event loop or hold the block index lock."""
        with self._unfinished:
            self._num_unfinished += 1

        def run() -> None:
            try:
                work()
            except Exception:
                log.exception("background move failed")
            finally:
                with self._unfinished:
                    self._num_unfinished -= 1
                    self._unfinished.notify_all()

        (executor or self.movers).submit(run)

    def close_threads(self) -> None:
        """After wait_quiet: stop the mover, spill, write-through and finalizer threads."""
        for executor in (self.movers, self.spiller, self.through, self.finalizer):
            executor.shutdown(wait=True)

    def wait_quiet(self, timeout_s: float | None = None) -> bool:
        """Until every transfer has landed and every finalizer and dispatched move (which may
        start more) returned; False when `timeout_s` passed first (None: no limit)."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        with self._unfinished:
            if not self._unfinished.wait_for(lambda: self._num_unfinished == 0, timeout_s):
                return False
        return self.engine.wait_idle(None if deadline_s is None else max(0.0, deadline_s - time.monotonic()))

    def recoded_for_t1(self, codec: BlockCodec, rows: torch.Tensor) -> torch.Tensor:
        """Rows of a lower tier's `codec` in T1's."""
        assert self.host is not None, "T1 is on"
        return recoded(codec, rows, self.host.codec)


def recoded(source: BlockCodec, rows: torch.Tensor, target: BlockCodec) -> torch.Tensor:
    """`rows` of `source`'s slots in `target`'s (the same tensor when the codecs agree)."""
    return rows if source.name == target.name else transcode(source, rows, target)


def transcode(source: BlockCodec, rows: torch.Tensor, target: BlockCodec) -> torch.Tensor:
    """Slot rows of one codec as slot rows of another, through a host block tensor."""
    ids = list(range(rows.shape[0]))
    blocks = torch.empty((len(ids), *source.layout.block_shape), dtype=source.layout.torch_dtype)
    source.decode(rows, ids, blocks, ids)
    out = torch.empty((len(ids), target.slot_nbytes), dtype=torch.uint8)
    target.encode(blocks, ids, out, ids)
    return out


def _logged(finalize: Callable[[BaseException | None], None], error: BaseException | None) -> None:
    try:
        finalize(error)
    except Exception:
        log.exception("finalizing a transfer failed")
