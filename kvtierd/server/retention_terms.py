"""Retention hints as the KvTier requests name them (RetentionHint, RetainRequest), checked and
turned into the core's terms (kvtierd/retention, tiering/retention_hints.py). Every check comes
before the first change: a bad hint changes nothing."""

from __future__ import annotations

from collections.abc import Sequence

from kvtierd.daemon_key import DaemonKey
from kvtierd.errors import InvalidArgument
from kvtierd.node.pools import LayoutPool
from kvtierd.node.tenants import Tenant
from kvtierd.retention.hint import RetentionHint, check_hint, check_session
from kvtierd.tiering.retention_hints import RetainOutcome
from kvtierd.token_bytes import TokenBytes
from kvtierd.v1 import kvtier_pb2 as pb

UNBOUNDED_TOKENS = 1 << 32  # a Put's chain before its blocks have arrived: its end is checked after


def hint_of(message: pb.RetentionHint, pool: LayoutPool, num_chain_tokens: int) -> RetentionHint:
    """The checked hint of `message` over a chain of `num_chain_tokens` tokens."""
    return check_hint(message.retention_session, message.priority, message.ttl_s, message.start_token,
                      message.end_token, num_chain_tokens, pool.manager.tiers.config.retention.max_ttl_s)


def check_put_end(hint: RetentionHint, num_blocks: int, block_size: int) -> RetentionHint:
    """A Put's hint once its blocks are known: the range within them (both 0: every block)."""
    num_tokens = num_blocks * block_size
    if hint.end_token == UNBOUNDED_TOKENS:
        return RetentionHint(hint.session, hint.priority, hint.ttl_s, hint.start_token, num_tokens)
    if hint.end_token > num_tokens:
        raise InvalidArgument(f"retention end_token {hint.end_token} is past the Put's {num_tokens} tokens")
    return hint


def retain(tenant: Tenant, pool: LayoutPool | None, request: pb.RetainRequest, keys: Sequence[DaemonKey],
           token_bytes: TokenBytes | None) -> pb.RetainResponse:
    """The Retain RPC on `pool` (None: a layout the daemon does not hold: nothing found)."""
    action = request.action
    if action not in (pb.RetainRequest.RETAIN, pb.RetainRequest.RELEASE, pb.RetainRequest.PREFETCH):
        raise InvalidArgument(f"RetainRequest.action must be RETAIN, RELEASE or PREFETCH, got {action}")
    has_hint = request.HasField("hint")
    if action == pb.RetainRequest.RELEASE:
        session = check_session(request.hint.retention_session)
        if pool is None:
            return pb.RetainResponse()
        released = pool.manager.retention.release(tenant.tag, session, keys or None)
        return pb.RetainResponse(num_released_hints=released)
    if action == pb.RetainRequest.RETAIN and not has_hint:
        raise InvalidArgument("RETAIN needs a hint")
    if not keys:
        raise InvalidArgument(f"{pb.RetainRequest.Action.Name(action)} needs the chain's block hashes")
    if pool is None:
        return pb.RetainResponse()
    manager = pool.manager
    hint = hint_of(request.hint, pool, len(keys) * pool.layout.block_size) if has_hint else None
    hits = manager.lookup(list(keys), token_bytes, prefetch=action == pb.RetainRequest.PREFETCH, ask_remote=False)
    num_found = hits.t0 + hits.t1 + hits.t2
    outcome = manager.retention.retain(keys[:num_found], hint) if hint is not None else RetainOutcome(0, 0)
    return pb.RetainResponse(num_found_blocks=num_found, num_retained_blocks=outcome.num_retained_blocks,
                             num_downgraded_blocks=outcome.num_downgraded_blocks,
                             downgrade_reason=outcome.downgrade_reason,
                             num_prefetched_blocks=hits.t2 if action == pb.RetainRequest.PREFETCH else 0)


def retain_committed(pool: LayoutPool, request_key: object, num_blocks: int, hint: RetentionHint) -> RetainOutcome:
    """A Commit's hint on the request's first `num_blocks` blocks (those holding a hash)."""
    index = pool.manager.tiers.index
    chain: list[DaemonKey] = []
    for block_id in pool.manager.block_table(request_key)[:num_blocks]:
        block_hash = index.blocks[block_id].block_hash
        if block_hash is None:
            break
        chain.append(block_hash)
    return pool.manager.retention.retain(chain, hint)
