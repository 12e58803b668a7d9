"""`kvtierd serve` whose T2 is slow: each slot-file write sleeps SLOW_T2_WRITE_DELAY_S first.

The fault a dying or contended disk shows (tests/server/test_loop_never_blocks.py); run as
`python -P -m tests.server.slow_t2_serve serve ...` with the repository on PYTHONPATH.
"""

from __future__ import annotations

import os
import sys
import time

from kvtierd.cli.kvtierd_main import main
from kvtierd.t2.ssd_files import SlotFiles

DELAY_S = float(os.environ["SLOW_T2_WRITE_DELAY_S"])
_write_run = SlotFiles.write_run


def slow_write_run(self, run, sources) -> None:
    time.sleep(DELAY_S)
    _write_run(self, run, sources)


SlotFiles.write_run = slow_write_run

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
