"""How many distinct block keys a pool has ever stored: a HyperLogLog (Flajolet et al., 2007, with
linear counting below 2.5 m as in Heule et al., 2013), 2^14 one-byte registers (16 KiB), a
standard error of 1.04 / 2^7 = 0.8 %.

The keys are already uniform hashes (sha256 or xxh3-128 of the chain: daemon_key.py), so a key's
last 8 bytes serve as its 64-bit hash: the first PRECISION bits pick a register, the rank of the
first set bit of the rest is kept if higher. Adding a key again changes nothing: a block stored
twice (a copy, a promotion) counts once.

What it is for: an unbounded cache misses a block only the first time it is seen, so on the same
traffic it would have hit every queried token but those of the distinct blocks stored
(`unbounded_hit_blocks`); beside the real hit rate this is what more capacity could buy.
"""

from __future__ import annotations

import numpy as np

PRECISION = 14  # registers = 2^14
NUM_REGISTERS = 1 << PRECISION
_REST_BITS = 64 - PRECISION
_REST_MASK = (1 << _REST_BITS) - 1
_ALPHA = 0.7213 / (1 + 1.079 / NUM_REGISTERS)


class DistinctKeys:
    """A HyperLogLog of block keys. `add` runs under the owning index's lock (one writer at a
    time); `estimate` reads without it (a register read mid-update is only ever lower)."""

    __slots__ = ("_registers",)

    def __init__(self) -> None:
        self._registers = bytearray(NUM_REGISTERS)

    def add(self, key: bytes) -> None:
        assert len(key) >= 8, "a key ends with a hash of 8 bytes or more"
        value = int.from_bytes(key[-8:], "little")
        rest = value & _REST_MASK
        rank = _REST_BITS - rest.bit_length() + 1  # position of the first set bit; all zero: _REST_BITS + 1
        index = value >> _REST_BITS
        if rank > self._registers[index]:
            self._registers[index] = rank

    def estimate(self) -> int:
        """The number of distinct keys added, within a few 0.8 % standard errors."""
        registers = np.frombuffer(bytes(self._registers), dtype=np.uint8)
        num_zero = int(np.count_nonzero(registers == 0))
        raw = _ALPHA * NUM_REGISTERS ** 2 / float(np.ldexp(1.0, -registers.astype(np.int32)).sum())
        if raw <= 2.5 * NUM_REGISTERS and num_zero:
            return round(NUM_REGISTERS * np.log(NUM_REGISTERS / num_zero))  # linear counting
        return round(raw)


def unbounded_hit_blocks(num_query_blocks: int, num_hit_blocks: int, num_distinct_blocks: int) -> int:
    """The query blocks an unbounded cache would have served on the same traffic: all but a first
    sight of each distinct block stored, never fewer than the real hits (T2 recovered from a
    restart and T3 filled by other nodes hit blocks this pool never stored) nor below 0."""
    return min(num_query_blocks, max(num_hit_blocks, num_query_blocks - num_distinct_blocks))
