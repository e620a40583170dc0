"""`conductor samples`: regenerate the sample query sets from a seed, so the
committed files in data/queries can always be rebuilt and checked."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from conductor import argtypes
from conductor.errors import ConductorError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("samples", help="write the seeded sample query sets",
                              description="Write the sample query sets (arithmetic, choice, factual, finance "
                                          "and the mixed demo set) as Parquet files.")
    p.add_argument("--out", type=argtypes.path, default=Path("data/queries"), help="folder to write into (default: data/queries)")
    p.add_argument("--seed", type=int, default=7, help="generator seed; the same seed gives the same files (default: 7)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from conductor.queries import load_queries
    from conductor.samples import generate

    if args.out.exists() and not args.out.is_dir():
        raise ConductorError(f"--out {args.out}: exists and is not a folder")
    try:
        paths = generate(args.out, seed=args.seed)
    except OSError as e:
        raise ConductorError(f"--out {args.out}: cannot write ({e.strerror or e})") from None
    for name, path in paths.items():
        table = load_queries(path)  # read back through the same check every consumer uses
        tasks = Counter(table.column("task").to_pylist())
        per_task = ", ".join(f"{task} {n}" for task, n in sorted(tasks.items()))
        print(f"{path}  {table.num_rows} rows  ({per_task})")
    return 0
