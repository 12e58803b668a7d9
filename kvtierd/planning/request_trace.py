"""A recorded run's requests, for `kvtierd simulate --trace`: one JSON object per line.

Each line is one request as the engine saw it: when it was sent and when it finished (seconds from
the start of the run), its session and turn, its prompt's token ids, and the retention hint it
carried (its time to live; 0 = none). A benchmark against a real server writes the requests it
really sent, with the times it really saw; the simulator replays them in that order, so its hit
rates can be checked against the real run's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a recorded run; times in seconds from the run's start."""

    start_s: float
    end_s: float
    session: int
    turn: int
    prompt_token_ids: tuple[int, ...]
    hint_ttl_s: float = 0.0  # the retention hint the request carried for its whole prompt; 0 = none
    hint_priority: int = 2  # its priority: 1 low, 2 normal, 3 high (retention.hint.Priority)

    def __post_init__(self) -> None:
        if not 0.0 <= self.start_s <= self.end_s:
            raise ValueError(f"request of session {self.session} turn {self.turn}: start {self.start_s} s "
                             f"and end {self.end_s} s are not an interval from the run's start")
        if self.hint_ttl_s < 0.0 or not 1 <= self.hint_priority <= 3:
            raise ValueError(f"request of session {self.session} turn {self.turn}: a hint needs ttl_s >= 0 "
                             f"and a priority of 1 (low) to 3 (high)")

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["prompt_token_ids"] = list(self.prompt_token_ids)
        return json.dumps(fields, separators=(",", ":"))


def write_trace(path: Path, requests: Iterable[TraceRequest]) -> int:
    """Write the requests, one per line; returns how many."""
    num_requests = 0
    with path.open("w") as out:
        for request in requests:
            out.write(request.to_json() + "\n")
            num_requests += 1
    return num_requests


def read_trace(path: Path) -> list[TraceRequest]:
    """The requests of a trace file, in the order they were sent. A malformed line is a ValueError
    naming the file and the line."""
    requests: list[TraceRequest] = []
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                fields = json.loads(line)
                fields["prompt_token_ids"] = tuple(int(t) for t in fields["prompt_token_ids"])
                requests.append(TraceRequest(**fields))
            except (ValueError, TypeError, KeyError) as error:
                raise ValueError(f"{path}:{number}: not a trace request ({error})") from None
    return sorted(requests, key=lambda request: request.start_s)
