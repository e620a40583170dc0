"""argparse types shared by every command line (the `conductor` commands and the
servers' own): 2**64 as a seed, 70000 as a port or '' as a path is argparse's message
naming the flag, not a traceback, a port wrapped around or files in the current folder."""

from __future__ import annotations

import argparse
from pathlib import Path


def int_in(low: int, high: int):
    """A whole number in [low, high]."""
    return _in_range(int, "a whole number", low, high)


def number_in(low: float, high: float):
    """A finite number in [low, high]."""
    return _in_range(float, "a number", low, high)


def _in_range(convert, noun: str, low, high):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not low <= value <= high:  # NaN too
            raise argparse.ArgumentTypeError(f"{text.strip()} is out of range ({low:g} to {high:g})"
                                             if isinstance(low, float) else
                                             f"{text.strip()} is out of range ({low} to {high})")
        return value
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
