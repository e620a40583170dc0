"""Options several commands share, declared once so they read the same everywhere.

Only the standard library and light `conductor` modules are imported here: building
the parser (and so `conductor --help`) must not load the table, HTTP or model stacks."""

from __future__ import annotations

import argparse
from pathlib import Path

from conductor import argtypes
from conductor.argtypes import SEED, int_in  # noqa: F401  (int_in: for the commands' own ranges)
from conductor.errors import ConductorError


def data_dir(p: argparse.ArgumentParser, help: str = "where runs, cache and catalog live (default data)") -> None:
    p.add_argument("--data-dir", type=argtypes.path, default=Path("data"), help=help)


def pool(p: argparse.ArgumentParser, help: str = "pool file (YAML)") -> None:
    p.add_argument("--pool", type=argtypes.path, required=True, help=help)


def run_id(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--run-id", type=argtypes.run_id, default=None, help=help)


def seed(p: argparse.ArgumentParser, help: str = "random seed, 0 or more (default 0)") -> None:
    p.add_argument("--seed", type=SEED, default=0, help=help)


def quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress line")


def max_steps(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-steps", type=int, default=5, help="most steps a plan may have (default 5)")


def cost_penalty(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost-penalty", type=float, default=0.0, help="reward points subtracted per USD (default 0)")


def planner_limit(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--planner-limit", type=int, default=None, metavar="N", help=help)


def report_out(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--out", type=argtypes.path, default=None, help=help)


DASH_VALUED = ("--target",)  # flags whose values may start with "-" (a target of -0.01:0.15)


def join_dash_values(argv: list[str]) -> list[str]:
    """argparse reads `--target -0.01:0.15` as two flags (it takes only plain negative
    numbers for values); `--target=-0.01:0.15` it reads as meant."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in DASH_VALUED and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def parse_options(items: list[str]) -> dict:
    """--planner-option KEY=VALUE pairs; values are read as YAML scalars (20, on, a string)."""
    from conductor import yamlkeys

    out = {}
    for item in items:
        if "=" not in item:
            raise ConductorError(f"--planner-option {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        if not k.strip():
            # the value is not shown: it may be a key pasted without its option's name
            raise ConductorError("--planner-option =VALUE: the option has no name before '=' (expected KEY=VALUE, "
                                 "e.g. temperature=0.5)")
        out[k.strip()] = yamlkeys.load(v)
    return out
