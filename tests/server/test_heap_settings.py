"""The daemon's malloc thresholds: block-sized buffers come from the heap and stay there once freed
(no fresh pages, no page faults, for the next one); an operator's own glibc settings win."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

# Run in a child: the thresholds are process-wide. mallinfo2 (glibc >= 2.33) tells where the
# bytes are: `hblkhd` mmap'd chunks, `arena` the heap, `fordblks` free bytes the heap keeps.
PROBE = """
import ctypes, json, sys
from kvtierd.server.heap_settings import keep_block_buffers_in_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2
applied = keep_block_buffers_in_heap()
block = bytes(2 << 20)
buffers = [b"".join([b"x", block]) for _ in range(8)]  # 8 live block-sized buffers, as a Get batch
live = mallinfo2()
del buffers
freed = mallinfo2()
print(json.dumps({"applied": applied, "mmapped_live": live.hblkhd, "heap_free_after": freed.fordblks}))
"""


def probe(**environment: str) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    result = subprocess.run([sys.executable, "-c", PROBE], env={**env, **environment}, capture_output=True,
                            text=True, check=True)
    return json.loads(result.stdout)


@pytest.fixture(autouse=True)
def glibc() -> None:
    try:
        ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("not glibc >= 2.33: the daemon changes nothing there")


def test_block_buffers_come_from_the_heap_and_stay_there():
    result = probe()
    assert result["applied"] is True
    assert result["mmapped_live"] < 2 << 20  # none of the 8 buffers was mmap'd
    assert result["heap_free_after"] >= 8 * (2 << 20)  # freed, kept for the next ones


def test_glibcs_defaults_hand_the_pages_back():
    """What the thresholds change: without them the same buffers are mmap'd or trimmed away."""
    result = probe(MALLOC_TRIM_THRESHOLD_="131072")  # glibc's default, set by hand: the daemon leaves it
    assert result["applied"] is False
    assert result["mmapped_live"] >= 2 << 20 or result["heap_free_after"] < 8 * (2 << 20)


@pytest.mark.parametrize("name, value", [("MALLOC_MMAP_THRESHOLD_", "1048576"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")])
def test_an_operators_settings_win(name, value):
    assert probe(**{name: value})["applied"] is False
