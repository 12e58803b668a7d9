"""One node of the shared store as the client sees it (its connection pool, breaker and last
answer) and the store's health as the daemon reports it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import redis

from kvtierd.t3.circuit_breaker import BreakerState, CircuitBreaker

Address = tuple[str, int]


@dataclasses.dataclass(eq=False)
class StoreNode:
    address: Address
    client: redis.Redis
    breaker: CircuitBreaker
    answering: bool = True  # its last call succeeded (or none was made yet)
    failure: tuple[str, bool] = ("", False)  # why its last failed call failed; credentials refused

    @property
    def reachable(self) -> bool:
        return self.answering and self.breaker.state is BreakerState.CLOSED


@dataclasses.dataclass(frozen=True, slots=True)
class StoreHealth:
    mode: str  # "cluster", "single", or "unknown" while no seed answered
    state: BreakerState  # the worst node's: open if any node (or the seeds) is open
    num_nodes: int
    num_open_nodes: int  # not answering: breaker open or half-open, or its last call failed
    num_errors: int  # failed calls to a node, since start
    num_opened: int  # times a breaker opened, since start
    last_error: str = ""  # "host:port: why", of the last failed call; "" while every node answers
    credentials_refused: bool = False  # that failure was the store refusing remote.username / password

    @property
    def serving(self) -> bool:
        return self.mode != "unknown" and self.num_open_nodes == 0 and self.state is BreakerState.CLOSED


def endpoint_names(endpoints: Iterable[Address]) -> str:
    """`host:port,host:port`: how logs and errors name store nodes."""
    return ",".join(f"{host}:{port}" for host, port in endpoints)
