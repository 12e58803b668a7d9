"""The daemon file's [events] section: the KV event feed in vLLM's wire format (zmq_publisher.py,
vllm_events.py). It reveals every tenant's prefixes: off by default, and only on this machine
unless allow_remote. No torch here."""

from __future__ import annotations

import dataclasses
import re

from kvtierd.config_checks import require, require_choice

EVENT_FORMATS = ("map", "array")  # vLLM KV events: tagged maps (vLLM #42892 on, 0.32 here), positional (older)
EVENT_SALTS = ("tenant", "none")


@dataclasses.dataclass(frozen=True, slots=True)
class EventsConfig:
    """[events]: where the feed goes and how it is written (vllm_events.WireFormat takes the last four)."""

    zmq_endpoint: str = ""  # ZMQ PUB: "tcp://127.0.0.1:5557", "ipc:///run/kvtierd/events"; "" = off
    replay_endpoint: str = ""  # ZMQ ROUTER answering "batches from seq N" (vLLM's replay); "" = none
    connect: bool = False  # connect the PUB socket to zmq_endpoint (a subscriber that binds) instead of binding
    topic: str = "kvtierd"  # first frame of every message; "{model}" is replaced by the pool's model id
    buffer_steps: int = 10_000  # batches kept for replay
    max_queued_events: int = 100_000  # events waiting for the publisher thread; beyond it they are dropped, counted
    format: str = "map"  # "map" | "array"
    int_block_hashes: bool = True  # hashes as u64 ints, as vLLM by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
    salt: str = "tenant"  # "tenant": a chain's first block carries its tenant's name in extra_keys | "none"
    lower_tiers: bool = True  # also publish T1 (medium CPU) and T2 (medium STORAGE), not only T0 (GPU)
    allow_remote: bool = False  # allow a non-loopback endpoint (prefixes leave the machine)

    def __post_init__(self) -> None:
        require(not self.replay_endpoint or self.zmq_endpoint, "events.replay_endpoint needs events.zmq_endpoint")
        require(self.buffer_steps >= 1, f"events.buffer_steps must be >= 1, got {self.buffer_steps}")
        require(self.max_queued_events >= 1, f"events.max_queued_events must be >= 1, got {self.max_queued_events}")
        for key, endpoint in (("events.zmq_endpoint", self.zmq_endpoint),
                              ("events.replay_endpoint", self.replay_endpoint)):
            if endpoint:
                require(re.fullmatch(r"(tcp://\S+:(\d+|\*)|ipc://\S+|inproc://\S+)", endpoint),
                        f"{key} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME; got {endpoint!r}")
                require(self.allow_remote or is_local_endpoint(endpoint),
                        f"{key} {endpoint!r} is not a loopback address: KV events reveal every tenant's prefixes; "
                        "bind 127.0.0.1 or ipc://, or set events.allow_remote = true")
        require_choice("events.format", self.format, EVENT_FORMATS)
        require_choice("events.salt", self.salt, EVENT_SALTS)


def is_local_endpoint(endpoint: str) -> bool:
    """A ZMQ endpoint only this machine reaches: ipc://, inproc://, or tcp on a loopback address."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host == "localhost" or host == "::1" or re.fullmatch(r"127(\.\d{1,3}){3}", host) is not None
