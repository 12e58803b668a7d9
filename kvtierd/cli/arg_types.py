"""Argument types shared by the `kvtierd` subcommands' parsers."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """A positive integer, or argparse's one-line error naming the text."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
