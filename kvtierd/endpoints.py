"""Where the daemon listens unless told otherwise: said once for `kvtierd serve` and its clients."""

from __future__ import annotations

import os
from collections.abc import Mapping


def default_socket_path(environ: Mapping[str, str] = os.environ) -> str:
    """$XDG_RUNTIME_DIR/kvtierd.sock where that directory exists, else /tmp/kvtierd-<uid>/kvtierd.sock."""
    runtime_dir = environ.get("XDG_RUNTIME_DIR", "")
    if runtime_dir and os.path.isdir(runtime_dir):
        return os.path.join(runtime_dir, "kvtierd.sock")
    return f"/tmp/kvtierd-{os.getuid()}/kvtierd.sock"
