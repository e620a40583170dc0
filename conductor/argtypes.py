"""argparse types shared by every command line (the `conductor` commands and the
servers' own): 2**64 as a seed, 70000 as a port or '' as a path is argparse's message
naming the flag, not a traceback, a port wrapped around or files in the current folder."""

from __future__ import annotations

import argparse
from pathlib import Path


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


def number_in(low: float, high: float):
    """A finite number in [low, high]."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low <= x <= high:  # NaN too
            raise argparse.ArgumentTypeError(f"{text} is out of range ({low:g} to {high:g})")
        return x
    return parse


def run_id(text: str) -> str:
    """Not empty: '' quietly became the default run id."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty run id; give one, or leave the flag out for the default")
    return text


SEED = int_in(0, 2 ** 63 - 1)
PORT = int_in(0, 65535)


def path(text: str) -> Path:
    """A path that is not empty: `Path('')` is the current folder, never what was meant."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or folder name")
    return Path(text)
