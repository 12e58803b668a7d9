"""Argument types of the command lines: the `kvtierd` subcommands' parsers (cli/) and the demo's
flags (connectors/demo/demo_cli.py), which use them without importing the CLI."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """A positive integer, or argparse's one-line error naming the text."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
