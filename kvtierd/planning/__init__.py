"""Sizing without a daemon: capacity of a pool, fragmentation, the capacity plan, the chat simulation."""
