"""The scheduler's LookupFn: one Lookup RPC per TP rank asks for every group's candidate blocks.

Per rank the request holds one chain per full-attention or sliding-window group (the group's keys
of the candidate positions, matched as a chain: its leading blocks) and, per Mamba group, a chain
of one per candidate position (a state is held or not wherever it sits); the answers become
per-position presence (group_hits.py), combined over ranks and groups into the hit. A rank whose
daemon cannot be asked makes the lookup a miss: a hit is what every rank holds. The trailing
blocks of a chain's hit that the daemon declines as slower to load than to recompute
(num_declined_blocks) are no hit: vLLM computes them, and the hit says how many the first rank's
primary group declined, per tier (`RequestHit.declined`, for vLLM's metrics).

The query: a request's first lookup names its candidate positions as one query of the daemon's
hit rate (LookupRequest.num_query_blocks, of the Lookup's first chain: the primary group's, asked
first, group_hits.primary_group). Each rank's daemon counts it once, there: the query blocks, the
hits it promises tier by tier, the declined ones; the loads that follow count nothing. So a pool's
hit rate is vLLM's external hit rate over the tokens vLLM asks the connector about (docs/vllm.md),
as long as the other groups and ranks hold what the primary group holds (they are stored
together). A model of Mamba groups only names no query.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from kvtierd.chain_lookup import ChainLookup
from kvtierd.connectors.daemon_link import DaemonLink
from kvtierd.connectors.vllm.group_hits import (
    ABSENT,
    NO_HIT,
    Presence,
    RequestHit,
    across_ranks,
    leading_presence,
    primary_group,
    request_hit,
)
from kvtierd.connectors.vllm.kv_groups import EngineGroups, GroupKind
from kvtierd.connectors.vllm.lookup_query import LookupFn, LookupQuery
from kvtierd.errors import KvtierError
from kvtierd.tier import TierCounts

log = logging.getLogger(__name__)


def _state_presence(kept: TierCounts) -> int:
    """A chain of one block's answer (its hit less what is declined): ABSENT, or the tier's level + 1
    that holds it."""
    return next((tier.level + 1 for tier, count in kept.items() if count), ABSENT)


def lookup_order(engine: EngineGroups) -> list[int]:
    """The groups' indexes in the order one Lookup asks them: the primary group first (its chain is
    the query), then the others in engine order."""
    primary = primary_group(engine.groups)
    return [primary] + [i for i in range(len(engine.groups)) if i != primary]


def lookup_request(engine: EngineGroups, query: LookupQuery) -> tuple[list[bytes], list[int], list[int]]:
    """(block hashes, token ids, chain lengths) of the one Lookup that asks for every group."""
    num_positions = query.num_positions
    hashes: list[bytes] = []
    tokens: list[int] = []
    lengths: list[int] = []
    for index in lookup_order(engine):
        hashes.extend(query.keys[index])
        tokens.extend(query.token_ids)  # a Mamba group's chains of one carry their own blocks' tokens: the same list
        lengths.extend([1] * num_positions if engine.groups[index].kind is GroupKind.MAMBA else [num_positions])
    return hashes, tokens, lengths


def num_query_blocks(engine: EngineGroups, query: LookupQuery) -> int:
    """What the daemon counts as the query, of the first chain (the primary group's): every
    candidate position, as vLLM's hit is counted in positions; 0 for a lookup asked again, and for
    a model of Mamba groups only (its first chain is one position's state)."""
    if not query.count_query or engine.groups[primary_group(engine.groups)].kind is GroupKind.MAMBA:
        return 0
    return query.num_positions


def group_presence(engine: EngineGroups, answer: ChainLookup, num_positions: int) -> tuple[list[Presence], TierCounts]:
    """Each group's presence (in engine order) from the chains' answers, in the order lookup_request
    asked them, and what the daemon declined of the primary group's chain."""
    answers = iter(zip(answer.kept, answer.declined))
    presence: list[Presence] = [[] for _ in engine.groups]
    primary_declined = TierCounts()
    for index in lookup_order(engine):
        if engine.groups[index].kind is GroupKind.MAMBA:
            presence[index] = [_state_presence(next(answers)[0]) for _ in range(num_positions)]
        else:
            kept, declined = next(answers)
            presence[index] = leading_presence(kept, num_positions)
            if index == primary_group(engine.groups):
                primary_declined = declined
    return presence, primary_declined


def _ask(link: DaemonLink, engine: EngineGroups, query: LookupQuery,
         prefetch: bool) -> tuple[list[Presence], TierCounts] | None:
    session = link.session()
    if session is None:
        return None
    hashes, tokens, lengths = lookup_request(engine, query)
    if any(len(block_hash) != session.hash_size for block_hash in hashes):
        log.warning("kvtierd connector: vLLM block hashes are not %d bytes (hash_algo %s); no lookup",
                    session.hash_size, link.hash_algo)
        return None
    try:
        answer = session.lookup(hashes, token_ids=tokens, prefetch=prefetch, chain_lengths=lengths,
                                num_query_blocks=num_query_blocks(engine, query), hold_id=query.hold_id)
    except KvtierError as error:  # an answer of fewer chains than asked (an older daemon) too
        link.failed(session, error)
        log.warning("kvtierd connector: lookup failed (%s: %s); counting no hit", type(error).__name__, error)
        return None
    return group_presence(engine, answer, query.num_positions)


def daemon_lookup(links: Sequence[DaemonLink], engine: EngineGroups, *, prefetch: bool = True) -> LookupFn:
    """A LookupFn asking the daemon of every rank (`links`, one per TP rank's layout); no hit when
    any cannot be asked."""
    def lookup(query: LookupQuery) -> RequestHit:
        per_rank, declined = [], TierCounts()
        for link in links:
            answer = _ask(link, engine, query, prefetch)
            if answer is None:
                return NO_HIT
            per_rank.append(answer[0])
            declined = answer[1] if link is links[0] else declined
        hit = request_hit(engine.groups, [across_ranks([rank[i] for rank in per_rank])
                                          for i in range(len(engine.groups))])
        return dataclasses.replace(hit, declined=declined)
    return lookup
