"""`conductor sql`: query every run's outputs with SQL through the DuckDB catalog."""

from __future__ import annotations

import argparse
from pathlib import Path

import duckdb

from conductor.errors import ConductorError
from conductor.store import refresh_catalog


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sql", help="run a SQL query over the outputs (views plans, traces, results, rewards, runs)")
    p.add_argument("query", help='e.g. "SELECT status, count(*) FROM results GROUP BY ALL"')
    p.add_argument("--data-dir", type=Path, default=Path("data"))
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.add_argument("--max-rows", type=int, default=100, help="rows shown in table format")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if not (args.data_dir / "runs").is_dir():
        raise ConductorError(f"no runs under {args.data_dir / 'runs'}: run `conductor run` first")
    db = refresh_catalog(args.data_dir)
    con = duckdb.connect(str(db), read_only=True)
    try:
        con.execute("SET TimeZone = 'UTC'")
        rel = con.sql(args.query)
        if rel is None:
            return 0
        if args.format == "csv":
            print(_csv(rel))
        elif args.format == "json":
            import orjson

            cols = rel.columns
            for row in rel.fetchall():
                print(orjson.dumps(dict(zip(cols, row)), default=str).decode())
        else:
            rel.show(max_rows=args.max_rows, max_width=200)
    except duckdb.Error as e:
        raise ConductorError(f"SQL error: {e}") from None
    finally:
        con.close()
    return 0


def _csv(rel) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(rel.columns)
    w.writerows(rel.fetchall())
    return buf.getvalue().rstrip("\n")
