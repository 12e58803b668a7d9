"""`kvtierd serve` as a daemon that predates CommitRequest.release: its Commit commits and leaves the
request held (CommitResponse.released stays False), so a client must fall back to Release.

Run as `python -P -m tests.server.commit_without_release_serve serve ...` with the repository on
PYTHONPATH.
"""

from __future__ import annotations

import sys

from kvtierd.cli.kvtierd_main import main
from kvtierd.server.servicer import KvTierServicer

_commit = KvTierServicer.Commit


async def commit_ignoring_release(self, request, context):
    request.release = False  # the field is unknown to such a daemon
    return await _commit(self, request, context)


KvTierServicer.Commit = commit_ignoring_release

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
