"""What the retention-hint tests ask of the daemon they run against."""

from __future__ import annotations

from kvtierd.client import KvtierClient
from kvtierd.client.calls import Call
from kvtierd.errors import KvtierError
from kvtierd.v1 import kvtier_pb2 as pb


def daemon_answers_retain(address: str) -> bool:
    """False for a daemon that predates retention hints (Retain UNIMPLEMENTED); an empty Retain is
    otherwise refused as malformed, changing nothing."""
    with KvtierClient(address) as client:
        try:
            client._run(Call("Retain", pb.RetainRequest()))
        except KvtierError as error:
            return error.code != "UNIMPLEMENTED"
    return True
