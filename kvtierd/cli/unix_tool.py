"""What makes `kvtierd` and `kvtierctl` behave as Unix tools.

- A closed pipe is not an error. `kvtierctl stats | head -1` closes the pipe under us; like
  coreutils the command then ends quietly, exit 0, no traceback (`quiet_on_closed_pipe`), and
  `stats --watch` stops as soon as its reader goes (`wait_unless_reader_gone`).
- A subcommand reports its own unknown arguments. argparse hands a subcommand's leftovers up to
  the top-level parser, whose error shows the top-level usage; `SubcommandParser` reports them
  itself: `kvtierd serve: error: unrecognized arguments: --bogus` under serve's usage line.
"""

from __future__ import annotations

import argparse
import functools
import os
import select
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol


class Main(Protocol):
    """A command's entry point: its arguments (None: sys.argv's) -> its exit status."""

    def __call__(self, argv: list[str] | None = None, /) -> int: ...


def quiet_on_closed_pipe(main: Main) -> Main:
    """`main` returning 0 when stdout's reader has gone, whenever that is found: while printing,
    at the final flush, or after argparse's --help / --version."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            try:
                status = main(argv)
            except SystemExit:  # argparse printed --help, --version or a usage error
                sys.stdout.flush()
                raise
            sys.stdout.flush()  # a short output is still buffered: find a closed pipe here, not at exit
            return status
        except BrokenPipeError:
            # Python flushes stdout once more at exit: point it at /dev/null, where that flush
            # finds no closed pipe (and prints no "Exception ignored" to stderr).
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 0

    return run


def wait_unless_reader_gone(seconds: float) -> bool:
    """Sleep `seconds`, or less: True as soon as stdout's reader has gone (the read end of a pipe
    closed: POLLERR; a socket's peer: POLLHUP). A terminal or a file just sleeps."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without one (a test's StringIO)
        fd = None
    if fd is None or not hasattr(select, "poll"):
        time.sleep(seconds)
        return False
    poller = select.poll()
    poller.register(fd, 0)  # no event asked for: poll reports only POLLERR, POLLHUP and POLLNVAL
    return bool(poller.poll(seconds * 1000))


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser (add_subparsers' parser_class) that refuses its unknown arguments
    itself, with its own prog and usage, instead of handing them up to the top-level parser."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

