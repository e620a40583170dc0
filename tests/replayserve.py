"""A recorded table written on the spot and served by `conductor replay serve` over real HTTP, with
the query set and pool `conductor replay` makes from it: what tests of whole runs on made-up
recorded answers share."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator

import polars as pl

from conductor.cli import main as cli_main
from conductor.localserver import start_server
from conductor.replay.main import READY
from conductor.replay.process import ReplayHandle


@contextlib.contextmanager
def served_table(d: Path, rows: list[dict], name: str) -> Iterator[dict]:
    """Yields {"dir", "queries", "pool", "server"}; the server stops after."""
    table = d / f"{name}.parquet"
    pl.DataFrame(rows).write_parquet(table)
    queries, pool = d / "queries.parquet", d / "pool.yaml"
    assert cli_main(["replay", "queries", "--table", str(table), "--split", "all", "--out", str(queries)]) == 0
    assert cli_main(["replay", "pool", "--table", str(table), "--out", str(pool)]) == 0
    cmd = [sys.executable, "-m", "conductor", "replay", "serve", "--pool", str(pool), "--port", "0"]
    with start_server(cmd, READY, ReplayHandle, "127.0.0.1", startup_timeout_s=60) as server:
        yield {"dir": d, "queries": queries, "pool": pool, "server": server}
