"""Retention hints: an agent's session kept warm through its tool pauses.

A hint (hint.py) names a retention session, a priority and a time to live; the daemon keeps the
live hints of a layout per block key (hint_table.py), and each local tier evicts blocks without a
live hint first, then by priority, least recently used within each (tier_retention.py: the class
of a block in one tier, and the tenant's quota there; the tiers' queues: index/classed_free_queue.py,
index/classed_lru.py). A retained block leaving T0 or T1 is written to the tier below first.
"""
