"""What a walk of a chain adds to the hit rate: its blocks as a query, the blocks it finds as hits.

A prefix query (a caller asking for a prompt it is about to compute) counts both; an Acquire
that loads what an earlier Lookup counted as the query counts only its hits; a caller acquiring
a chain to store blocks it computed counts neither (what it finds is not a hit: it had them).
"""

from __future__ import annotations

import enum


class QueryCounting(enum.Enum):
    QUERY_AND_HITS = "query and hits"
    HITS_ONLY = "hits only"
    NOTHING = "nothing"

    @property
    def counts_query(self) -> bool:
        return self is QueryCounting.QUERY_AND_HITS

    @property
    def counts_hits(self) -> bool:
        return self is not QueryCounting.NOTHING
