"""`conductor sql`: query every run's outputs with SQL through the DuckDB catalog.

Read only: the catalog is opened read-only and refreshed only when the set of
views changed; statements other than queries (COPY ... TO, INSTALL, ATTACH,
CREATE, SET) are refused, and extensions are never installed or loaded. When
another process holds the catalog file, the same views are built in memory
over the run files, and the answer says so in one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from conductor.cli import options
from conductor.errors import ConductorError

ALLOWED = ("SELECT", "EXPLAIN")  # duckdb.StatementType names: queries only


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sql", help="run a SQL query over the outputs (views plans, traces, results, rewards, runs)")
    p.add_argument("query", help='e.g. "SELECT status, count(*) FROM results GROUP BY ALL"')
    options.data_dir(p)
    p.add_argument("--store", metavar="s3://BUCKET/PREFIX",
                   help="query the runs kept on object storage instead (default: $CONDUCTOR_STORE)")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.add_argument("--max-rows", type=options.int_in(1, 10 ** 9), default=100, help="rows shown in table format")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import duckdb

    from conductor.execute.shared.objects import ObjectStore, catalog, store_url

    store = store_url(getattr(args, "store", None))
    if store is not None:
        try:
            con = catalog(ObjectStore(store))
        except OSError as e:
            raise ConductorError(f"store {store}: cannot read the runs there: {e}") from None
    elif not (args.data_dir / "runs").is_dir():
        raise ConductorError(f"no runs under {args.data_dir / 'runs'}: run `conductor run` first")
    else:
        con = _open(args.data_dir)
    try:
        con.execute("SET TimeZone = 'UTC'")
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("SET autoload_known_extensions = false")
        try:
            statements = con.extract_statements(args.query)
        except duckdb.Error as e:
            raise ConductorError(f"SQL error: {e}") from None
        if not statements:
            raise ConductorError("no SQL statement given (an empty string or only a comment)")
        # Named by their first word as written (DuckDB files INSTALL under LOAD).
        refused = sorted({(st.query.split() or [st.type.name])[0].upper() for st in statements
                          if st.type.name not in ALLOWED})
        if refused:
            raise ConductorError(f"conductor sql runs queries only (SELECT, WITH, DESCRIBE, SHOW, EXPLAIN); "
                                 f"refused: {', '.join(refused)} (the run files under DATA_DIR/runs are "
                                 f"Parquet: read or copy them directly)")
        if len(statements) > 1:
            raise ConductorError(f"conductor sql runs one query at a time; got {len(statements)} statements "
                                 f"(only the last one's rows would be shown)")
        rel = con.sql(args.query)
        if rel is None:
            return 0
        if args.format == "csv":
            print(_csv(rel))
        elif args.format == "json":
            cols = rel.columns
            for row in rel.fetchall():
                print(_json(dict(zip(cols, row))))
        else:
            rel.show(max_rows=args.max_rows, max_width=200)
    except duckdb.Error as e:
        raise ConductorError(f"SQL error: {e}") from None
    finally:
        con.close()
    return 0


def _open(data_dir: Path):
    """The catalog, read-only (refreshed first if its views changed); or, when another
    process holds it, the same views in memory."""
    import duckdb

    from conductor.store import CATALOG, CatalogHeld, catalog_is_current, create_views, refresh_catalog

    db = Path(data_dir).resolve() / CATALOG
    if not catalog_is_current(data_dir):
        try:
            refresh_catalog(data_dir, attempts=2)
        except CatalogHeld:
            pass  # held by another process: answered from memory below
    try:
        return duckdb.connect(str(db), read_only=True)
    except duckdb.Error as e:
        import sys

        if "lock" not in str(e).lower():
            raise ConductorError(f"cannot open {db} ({e}); it holds no data, only views over the runs' files: "
                                 f"delete it and rerun") from None

        print(f"conductor: {db} is held by another process; answering from the run files directly",
              file=sys.stderr)
        con = duckdb.connect(":memory:")
        create_views(con, Path(data_dir).resolve() / "runs")
        return con


def _csv(rel) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(rel.columns)
    w.writerows([_json(v) if isinstance(v, (list, dict, tuple)) else v for v in row] for row in rel.fetchall())
    return buf.getvalue().rstrip("\n")


def _json(value) -> str:
    """JSON for a row or a nested value: MAP keys need not be strings, and DECIMAL,
    UUID and INTERVAL values are written as their text."""
    import orjson

    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
