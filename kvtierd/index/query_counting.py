"""What a walk of a chain adds to the hit rate: its blocks as a query, the blocks it finds as hits.

A prefix query counts once, where it is asked. An engine that looks its prompt up first (the
vLLM connector's scheduler) names the query in that Lookup (LookupRequest.num_query_blocks): the
Lookup counts the query, the hits it promises tier by tier, and the hits it declines as slower to
load than to recompute (misses: the engine computes them); the Acquire that then loads the
promised blocks (AcquireRequest.query_counted) counts nothing. A caller that acquires a prompt
without asking first (the reference runner, a Get) is its own query: the Acquire counts the query
and the hits it loads. A caller acquiring a chain to store blocks it computed counts nothing (what
it finds is not a hit: it had them).
"""

from __future__ import annotations

import enum


class QueryCounting(enum.Enum):
    QUERY_AND_HITS = "query and hits"  # an Acquire that is its own query
    NOTHING = "nothing"  # a store's Acquire, or the load of what a Lookup counted

    @property
    def counts(self) -> bool:
        """Does the walk count its chain as a query and what it finds as hits?"""
        return self is QueryCounting.QUERY_AND_HITS
