"""py-spy on a daemon during part of a benchmark (`--profile DIR`), and a summary of its top frames.

The recording is py-spy's raw collapsed stacks (one line per distinct stack, its sample count last),
by thread; the summary counts, per thread family (kvtierd-mover_0, _1, ... as kvtierd-mover_*), the
frames of the packages named with the most samples anywhere on the stack ("incl"), then the frames on
top of the stack (what the thread was running, C code included with `native`: "self").
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ENTRY_FRAMES = ("kvtierd/cli/", "kvtierd/server/serve.py", "kvtierd/server/interceptor.py")  # on every stack
# Native stacks whose top is one of these wait (py-spy samples a thread blocked in a system call as
# busy when it pauses the process for native stacks); their samples are left out. A wait inside libc
# that py-spy cannot name (an address) is not recognised.
WAIT_FRAMES = ("epoll_wait (", "epoll_pwait (", "poll (", "select (", "pthread_cond_", "sem_wait", "futex")


def py_spy(pid: int, output: Path, rate_hz: int = 250, native: bool = False) -> subprocess.Popen:
    """Start `py-spy record` on `pid`, writing raw stacks to `output`; returns once attached. Without
    `native` the process is sampled without being paused; py-spy takes native stacks only by pausing
    it at each sample (the profiled run is then slower)."""
    binary = shutil.which("py-spy")
    if binary is None:
        raise SystemExit("--profile: py-spy is not installed (pip install py-spy)")
    output.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([binary, "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate_hz),
                                "--threads", *(["--native"] if native else ["--nonblocking"]), "-o", str(output)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)  # attached
    return process


def stop_py_spy(process: subprocess.Popen) -> None:
    """Stop a recording; py-spy writes its file on SIGINT."""
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=60)
    if process.returncode not in (0, -signal.SIGINT):
        print(f"py-spy exited with {process.returncode}: {out[-2000:]}", file=sys.stderr)


def summarize_profile(name: str, path: Path, top: int = 10, rate_hz: int = 250,
                      packages: Sequence[str] = ("kvtierd/", "redis/")) -> list[str]:
    """The `top` frames of `packages` by samples with the frame anywhere on the stack, then the
    `top` frames on top of the stack (any package), by thread family; one line each."""
    if not path.exists():
        return [f"profile {name}: py-spy wrote nothing ({path})"]
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread, _, frames = stack.partition(";") if stack.startswith("thread (") else ("", "", stack)
        family = re.sub(r"_\d+$", "_*", thread.partition(": ")[2])
        frame_list = frames.split(";")
        if any(frame_list[-1].startswith(w) or f" {w}" in frame_list[-1] for w in WAIT_FRAMES):
            continue
        total += int(count)
        for frame in dict.fromkeys(frame_list):
            if any(p in frame for p in packages) and not any(e in frame for e in ENTRY_FRAMES):
                inclusive[(family, frame)] += int(count)
        own[(family, frame_list[-1])] += int(count)
    lines = [f"profile {name}: {total} samples of busy threads at {rate_hz} Hz ({path}); {' / '.join(packages)} "
             "frames by samples with the frame anywhere on the stack, then samples with it on top:"]
    for title, counter in (("incl", inclusive), ("self", own)):
        for (family, frame), count in counter.most_common(top):
            lines.append(f"  {title} {100 * count / max(total, 1):5.1f}%  {family[:18]:18}  {frame}")
    return lines
