"""The client library of kvtierd: `KvtierClient` (blocking) and `AsyncKvtierClient` (asyncio).

`from kvtierd.client import KvtierClient` is the public path; the modules behind it are
sync_client.py, aio_client.py, what the two share: base.py (the channel, retries, errors) and
calls.py (each RPC's request and result), and block_data.py (token ids and block bytes as
callers hand them).
"""

from kvtierd.chain_lookup import ChainLookup
from kvtierd.client.aio_client import AsyncKvtierClient, AsyncSession
from kvtierd.client.base import TlsOptions
from kvtierd.client.block_data import PutResult
from kvtierd.client.calls import AcquireResult, CommitResult
from kvtierd.client.sync_client import EventStream, KvtierClient, Session

__all__ = ["KvtierClient", "Session", "EventStream", "TlsOptions", "AcquireResult", "CommitResult", "PutResult",
           "ChainLookup", "AsyncKvtierClient", "AsyncSession"]
