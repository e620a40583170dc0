"""argparse types for whole numbers in a range, shared by every command line (the
`conductor` commands and the servers' own): 2**64 as a seed or 70000 as a port is
argparse's message naming the flag, not a traceback or a port wrapped around."""

from __future__ import annotations

import argparse


def int_in(low: int, high: int):
    """A whole number in [low, high]."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"{n} is out of range ({low} to {high})")
        return n
    return parse


SEED = int_in(0, 2 ** 63 - 1)
PORT = int_in(0, 65535)
