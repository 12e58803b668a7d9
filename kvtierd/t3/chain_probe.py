"""How many leading blocks of a chain the shared store holds, in as few round trips as the chain
allows, and the answers an Acquire may reuse.

A chain's blocks are written in order and a load verifies every block it reads (block_frame.py),
stopping at the first that is missing or wrong. So a probe need not ask every key: it asks the
chain's first and last keys in one round trip (one pipeline per store node, every chain at once):

- first absent: nothing (the chain ends there);
- first present, last present (or the chain is one block): every block is taken as present;
- first present, last absent: the keys between are asked in a second round trip, and the answer
  is the exact length of the present run.

A block missing between a present first and last (evicted, on a failed node) is then claimed by
the probe and found missing by the load that follows: a miss counted there, the blocks before
it loaded. A Lookup of a 4k-token chain asks 2 keys instead of 256.

`RecentProbes` keeps the last answers for a short while so that the Acquire following a Lookup
of the same chain (vLLM's scheduler asks one, then the other) does not ask the store again.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

from kvtierd.daemon_key import DaemonKey

PROBE_ANSWER_TTL_S = 2.0  # how long an answer may be reused (a stale "present" is verified by the load)
MAX_PROBE_ANSWERS = 4096

Exists = Callable[[list[bytes]], list[bool]]  # store keys -> present?, one round trip


def probe_chains(chains: Sequence[Sequence[DaemonKey]], store_key: Callable[[DaemonKey], bytes],
                 exists: Exists) -> list[int]:
    """The number of leading blocks of each chain (daemon keys) taken as present (module doc)."""
    ends = [[chain[0]] if len(chain) == 1 else [chain[0], chain[-1]] for chain in chains if chain]
    flags = iter(exists([store_key(h) for pair in ends for h in pair]) if ends else ())
    answers: list[int] = []
    between: list[int] = []  # chains whose inner keys are asked in the second round trip
    for i, chain in enumerate(chains):
        if not chain:
            answers.append(0)
            continue
        first, last = next(flags), (next(flags) if len(chain) > 1 else True)
        answers.append(0 if not first else len(chain) if last else 1)
        if first and not last and len(chain) > 2:
            between.append(i)
    if between:
        inner = iter(exists([store_key(h) for i in between for h in chains[i][1:-1]]))
        for i in between:
            present = [next(inner) for _ in range(len(chains[i]) - 2)]
            answers[i] = 1 + (present.index(False) if False in present else len(present))
    return answers


class AlsoAsked:
    """An Exists that asks `extra_keys` too, in its first call's round trip (a sealed T3 probe's
    tenant key records: sealed_values.py); their answers are `extra_present` after that call."""

    def __init__(self, exists: Exists, extra_keys: Sequence[bytes]) -> None:
        self.exists, self.extra_keys = exists, list(extra_keys)
        self.extra_present: list[bool] | None = None  # None until the first call

    def __call__(self, keys: list[bytes]) -> list[bool]:
        if self.extra_present is not None:
            return self.exists(keys)
        flags = self.exists(keys + self.extra_keys)
        self.extra_present = flags[len(keys):]
        return flags[:len(keys)]


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeAnswer:
    last_key: DaemonKey  # the chain's last daemon key (the chain hash: it names every block before it)
    num_blocks: int  # the chain's length
    num_present: int
    misses_counted: bool  # its absent blocks were counted as T3 misses
    at_s: float  # time.monotonic() when asked


class RecentProbes:
    """Answers of the last probes, by the chain's first key; thread-safe, bounded (oldest dropped)."""

    def __init__(self, ttl_s: float = PROBE_ANSWER_TTL_S, max_answers: int = MAX_PROBE_ANSWERS) -> None:
        self.ttl_s = ttl_s
        self.max_answers = max_answers
        self._answers: collections.OrderedDict[DaemonKey, ProbeAnswer] = collections.OrderedDict()
        self._lock = threading.Lock()

    def remember(self, chain: Sequence[DaemonKey], num_present: int, misses_counted: bool) -> None:
        assert chain and 0 <= num_present <= len(chain)
        answer = ProbeAnswer(chain[-1], len(chain), num_present, misses_counted, time.monotonic())
        with self._lock:
            self._answers[chain[0]] = answer
            self._answers.move_to_end(chain[0])
            if len(self._answers) > self.max_answers:
                self._answers.popitem(last=False)

    def take(self, chain: Sequence[DaemonKey]) -> ProbeAnswer | None:
        """The recent answer for exactly this chain (same first and last key, same length), removed:
        one Lookup's answer serves one Acquire. None when there is none or it is older than ttl_s."""
        if not chain:
            return None
        with self._lock:
            answer = self._answers.get(chain[0])
            if (answer is None or answer.num_blocks != len(chain) or answer.last_key != chain[-1]
                    or time.monotonic() - answer.at_s > self.ttl_s):
                return None
            del self._answers[chain[0]]
            return answer
