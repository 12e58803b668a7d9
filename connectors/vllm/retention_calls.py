"""The worker side of retention hints: the hint on a store's Commit, the Retain of a RetainSpec,
and what the daemon answered, in the connector's stats.

Token ranges: a request's hint counts prompt tokens (retention_hints.py). A Commit's counts from
the first block of the daemon request that holds the blocks, i.e. the chain position of the
store's first acquired block (its parent, or position 0), and ends within the blocks acquired; a
Retain's counts from chain position 0 and ends within the chain it names. A hint is sent only
when it covers a block the call names (a range that covers none would read, both ends 0, as
"every block").

The daemon may refuse a well-formed hint (a ttl_s above its retention.max_ttl_s: INVALID_ARGUMENT,
and the Commit changes nothing): the Commit is sent again without it, so the blocks are stored
anyway, and the request's later calls carry no hint (logged once, counted once per request and
rank). A daemon that predates Retain (UNIMPLEMENTED) leaves the blocks held before the request
unrenewed (logged once).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvtierd.client import CommitResult, Session
from kvtierd.connectors.daemon_link import DaemonLink
from kvtierd.connectors.vllm.connector_stats import StatsRecorder
from kvtierd.connectors.vllm.metadata import GroupBlocks, RetainSpec
from kvtierd.connectors.vllm.retention_hints import PromptRetention
from kvtierd.errors import InvalidArgument, KvtierError
from kvtierd.v1 import kvtier_pb2 as pb

log = logging.getLogger(__name__)

PRIORITY_OF = {"low": pb.RetentionHint.LOW, "normal": pb.RetentionHint.NORMAL, "high": pb.RetentionHint.HIGH}


def hint_over(retention: PromptRetention, block_size: int, first_position: int, num_blocks: int,
              first_named: int = 0) -> pb.RetentionHint | None:
    """`retention` for a call on a chain of `num_blocks` blocks from chain position `first_position`
    that names its blocks from the `first_named`th on; None when it covers none of those."""
    offset = first_position * block_size
    start = max(retention.start_token - offset, 0)
    end = min(retention.end_token - offset, num_blocks * block_size)
    if max(-(-start // block_size), first_named) >= end // block_size:
        return None
    return pb.RetentionHint(retention_session=retention.session, priority=PRIORITY_OF[retention.priority],
                            ttl_s=retention.ttl_s, start_token=start, end_token=end)


class RetentionCalls:
    """One worker's hinted Commits and Retains.

    Invariant: `_refused_request_ids` are the live requests whose hint the daemon refused: their
    calls carry none (forgotten when vLLM names the request finished)."""

    def __init__(self, link: DaemonLink, stats: StatsRecorder, block_size: int) -> None:
        self.link = link
        self.stats = stats
        self.block_size = block_size
        self._lock = threading.Lock()  # guards the fields below (the store threads)
        self._refused_request_ids: set[str] = set()
        self._said_unimplemented = False

    def commit_and_release(self, session: Session, request_id: str, retention: PromptRetention | None,
                           daemon_request_id: str, blocks: GroupBlocks, num_held: int, block_ids: Sequence[int],
                           parent_hash: bytes | None) -> CommitResult:
        """Commit `blocks` from the `num_held`th on (the daemon request holds `blocks` from its first),
        with the request's hint over those it covers, and release the request."""
        block_size = len(blocks.token_ids) // blocks.num_blocks
        hashes, tokens = list(blocks.block_hashes[num_held:]), list(blocks.token_ids[num_held * block_size:])
        with self._lock:
            refused = request_id in self._refused_request_ids
        hint = None if retention is None or refused else \
            hint_over(retention, block_size, blocks.first_position, num_held + len(block_ids), num_held)
        if hint is None:
            return session.commit_and_release(daemon_request_id, block_ids, hashes, tokens, parent_hash)
        try:
            committed = session.commit_and_release(daemon_request_id, block_ids, hashes, tokens, parent_hash,
                                                   retention=hint)
        except InvalidArgument as error:  # a bad hint changed nothing: store without it
            committed = session.commit_and_release(daemon_request_id, block_ids, hashes, tokens, parent_hash)
            self._refused(request_id, error)
            return committed
        self._count(committed.num_retained_blocks, committed.num_downgraded_blocks)
        return committed

    def retain(self, spec: RetainSpec) -> None:
        """One Retain per chain of `spec` (run after the step's stores); failures are logged, never raised."""
        with self._lock:
            if spec.request_id in self._refused_request_ids:
                return
        session = self.link.session(attach=False)
        if session is None:
            return
        for chain in spec.chains:
            hint = hint_over(spec.retention, self.block_size, 0, len(chain))
            if hint is None:
                continue
            try:
                answer = session.retain(chain, hint)
            except InvalidArgument as error:
                self._refused(spec.request_id, error)
                return
            except KvtierError as error:
                self._failed(session, spec.request_id, error)
                return
            self._count(answer.num_retained_blocks, answer.num_downgraded_blocks)

    def forget(self, finished_request_ids: set[str]) -> None:
        with self._lock:
            self._refused_request_ids -= finished_request_ids

    def _count(self, num_retained_blocks: int, num_downgraded_blocks: int) -> None:
        self.stats.add("retained_blocks", num_retained_blocks)
        self.stats.add("downgraded_retention_blocks", num_downgraded_blocks)

    def _refused(self, request_id: str, error: KvtierError) -> None:
        with self._lock:
            if request_id in self._refused_request_ids:
                return
            self._refused_request_ids.add(request_id)
        self.stats.add("refused_retention_hints", 1)
        log.warning("kvtierd connector: request %s: kvtierd refused its retention hint (%s); storing it without "
                    "the hint", request_id, error)

    def _failed(self, session: Session, request_id: str, error: KvtierError) -> None:
        if error.code == "UNIMPLEMENTED":
            with self._lock:
                said, self._said_unimplemented = self._said_unimplemented, True
            if not said:
                log.warning("kvtierd connector: this kvtierd predates Retain: the retention hints of requests "
                            "cover their own stores only, not the blocks held before them")
            return
        self.link.failed(session, error)
        log.warning("kvtierd connector: the Retain of request %s failed (%s: %s)", request_id,
                    type(error).__name__, error)
