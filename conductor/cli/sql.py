"""`conductor sql`: query every run's outputs with SQL through the DuckDB catalog.

Read only: the catalog is opened read-only and refreshed only when the set of
views changed; statements other than queries (COPY ... TO, INSTALL, ATTACH,
CREATE, SET, and EXPLAIN ANALYZE of any of them, which would run it) are
refused, and extensions are never installed or loaded. When
another process holds the catalog file, the same views are built in memory
over the run files, and the answer says so in one line.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from conductor.cli import options
from conductor.errors import ConductorError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sql", help="run a SQL query over the outputs (views plans, traces, results, rewards, runs)")
    p.add_argument("query", help='e.g. "SELECT status, count(*) FROM results GROUP BY ALL"; '
                                 '"-" reads it from stdin (for a query too long for the command line)')
    options.data_dir(p)
    p.add_argument("--store", metavar="s3://BUCKET/PREFIX",
                   help="query the runs kept on object storage instead (default: $CONDUCTOR_STORE)")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.add_argument("--max-rows", type=options.int_in(1, 10 ** 9), default=100,
                   help="rows shown in table format (default 100)")
    p.add_argument("--max-width", type=options.int_in(40, 10 ** 6), default=200,
                   help="characters a row may take in table format (columns past it are left out; default 200)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import duckdb

    from conductor.execute.shared.objects import ObjectStore, catalog, store_url

    query = sys.stdin.read() if args.query == "-" else args.query
    store = store_url(getattr(args, "store", None))
    left_out: dict[str, str] = {}  # the store's views left out, and why
    if store is not None:
        objects = ObjectStore(store)
        objects.check_bucket()  # a mistyped bucket is named, as `conductor run` names it
        try:
            con = catalog(objects, left_out)
        except OSError as e:
            raise ConductorError(f"store {store}: cannot read the runs there: {e}") from None
    elif not (args.data_dir / "runs").is_dir():
        raise ConductorError(f"no runs under {args.data_dir / 'runs'}: run `conductor run` or `conductor job run` "
                             f"first")
    else:
        con = _open(args.data_dir)
    try:
        con.execute("SET TimeZone = 'UTC'")
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("SET autoload_known_extensions = false")
        con.execute("SET lock_configuration = true")  # nothing the query does can turn them back on
        try:
            statements = con.extract_statements(query)
        except duckdb.Error as e:
            raise ConductorError(f"SQL error: {e}") from None
        if not statements:
            raise ConductorError("no SQL statement given (an empty string or only a comment)")
        refused = sorted({word for st in statements if (word := _refused(con, st))})
        if refused:
            raise ConductorError(f"conductor sql runs queries only (SELECT, WITH, DESCRIBE, SHOW, EXPLAIN); "
                                 f"refused: {', '.join(refused)} (the run files under DATA_DIR/runs are "
                                 f"Parquet: read or copy them directly)")
        if len(statements) > 1:
            raise ConductorError(f"conductor sql runs one query at a time; got {len(statements)} statements "
                                 f"(only the last one's rows would be shown)")
        if args.format == "table":
            rel = con.sql(query)
            if rel is not None:
                rel.show(max_rows=args.max_rows, max_width=args.max_width)
        elif (rel := con.sql(query)) is not None:
            rel, nested = _intervals_as_text(rel)
            # JSON columns (the runs view's inputs and summary) as objects, not as strings of JSON
            nested |= {i for i, t in enumerate(rel.types) if str(t) == "JSON"}
            _stream(rel, args.format, nested)
    except duckdb.Error as e:  # a damaged file, or a column whose type differs between runs: say which, and what to do
        from conductor.store import damaged_file_advice, schema_clashes

        if (missing := _missing_view(str(e), store or args.data_dir / "runs", left_out)) is not None:
            raise ConductorError(f"SQL error: {missing}") from None  # not DuckDB's "Did you mean pg_tables?"
        advice = damaged_file_advice(str(e))
        if advice is None and store is None and isinstance(e, duckdb.ConversionException):
            advice = schema_clashes(args.data_dir / "runs", str(e))  # a cast DuckDB could not make, naming no file
        message = str(e)
        if args.format == "table":  # DuckDB's show() appends a LIMIT of its own to the query it quotes
            message = re.sub(r"^(LINE \d+:.*) LIMIT 10000$", r"\1", message, flags=re.M)
        raise ConductorError(f"SQL error: {message}" + (f"; {advice}" if advice else "")) from None
    finally:
        con.close()
    return 0


def _missing_view(message: str, runs, left_out: dict[str, str] | None = None) -> str | None:
    """Why a catalog view is missing, or None for any other error. A view is made once some run
    has its file: after runs refused before their first call there may be none, and traces,
    results and rewards are written when a run ends (the runs stopped before then are named).
    `left_out`: the store's views left out (its runs differ in a column's type), and why."""
    from conductor import schemas

    found = re.search(r"Table with name (\w+) does not exist", message)
    name = found.group(1).lower() if found else None
    if name is not None and name in (left_out or {}):
        return f"there is no view {name}: {left_out[name]}"
    if name is not None and name not in (*schemas.TABLES, "runs") and isinstance(runs, Path):
        from conductor.store import job_runs

        jobs = sorted(job_runs(runs))
        return (f"there is no view {found.group(1)}: the catalog's views are plans, traces, results, rewards, runs "
                f"and one per enrichment job that has a run under {runs} "
                f"({'jobs: ' + ', '.join(jobs) if jobs else 'none has'}); a job's view goes with its last run "
                f"folder, and `conductor job run` makes it again")
    if name not in (*schemas.TABLES, "runs"):
        return None
    what = "manifest.json" if name == "runs" else f"{name}.parquet"
    if isinstance(runs, Path) and next(runs.glob(f"*/{what}"), None) is not None:  # written, all left out
        return (f"there is no view {name}: every {what} under {runs} is damaged or unreadable (each is named "
                f"above, with what to do)")
    if name not in ("traces", "results", "rewards"):
        return (f"there is no view {name}: no run under {runs} has written a {what} yet (a run refused "
                f"before its first call writes none); `conductor run` or `conductor job run` first")
    unfinished = _unfinished(runs, what) if isinstance(runs, Path) else []
    shown = ", ".join(f"{run} ({'executing: still running, or killed' if status == 'executing' else status})"
                      for run, status in unfinished[:10])
    more = f" and {len(unfinished) - 10} more" if len(unfinished) > 10 else ""
    return (f"there is no view {name}: no run under {runs} has written a {what} yet. A run writes it when it "
            f"ends (one refused before its first call writes none); a run stopped before its end keeps the steps "
            f"it made, and paid for, in its work/ folder until the same command is run again to resume it" +
            (f". Not ended: {shown}{more}" if unfinished else "; `conductor run` or `conductor job run` first"))


def _unfinished(runs: Path, what: str) -> list[tuple[str, str]]:
    """The runs with a journal (work/steps.jsonl) but no `what` yet, with their manifests' status:
    stopped (or still running) before their end."""
    import orjson

    found = []
    for steps in sorted(runs.glob("*/work/steps.jsonl")):
        folder = steps.parent.parent
        if (folder / what).exists():
            continue
        try:
            status = orjson.loads((folder / "manifest.json").read_bytes()).get("status")
        except (OSError, ValueError, AttributeError):
            status = None
        found.append((folder.name, status if isinstance(status, str) else "no readable manifest"))
    return found


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
        if "lock" not in str(e).lower():
            raise ConductorError(f"cannot open {db} ({e}); it holds no data, only views over the runs' files: "
                                 f"delete it and rerun") from None

        print(f"conductor: {db} is held by another process; answering from the run files directly",
              file=sys.stderr)
        con = duckdb.connect(":memory:")
        create_views(con, Path(data_dir).resolve() / "runs")
        return con


def _refused(con, statement) -> str | None:
    """The first word of a statement that is not a query, else None. EXPLAIN ANALYZE runs
    the statement it wraps, so an EXPLAIN is a query only when what it wraps is one."""
    import duckdb

    word = (statement.query.split() or [statement.type.name])[0].upper()  # as written: DuckDB files INSTALL under LOAD
    if statement.type.name == "SELECT":
        return None
    if statement.type.name != "EXPLAIN":
        return word
    inner = _explained(statement.query)
    try:
        wrapped = con.extract_statements(inner) if inner is not None else []
    except duckdb.Error:
        wrapped = []
    if len(wrapped) == 1 and wrapped[0].type.name == "SELECT":
        return None
    first = (inner or "").split()
    return f"EXPLAIN {first[0].upper()}" if first else "EXPLAIN"


_BLANKS = re.compile(r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*", re.S)  # blanks and comments


def _explained(text: str) -> str | None:
    """What `EXPLAIN [ANALYZE] [(options)]` wraps, or None when the text is not of that form."""
    def skip(i: int) -> int:
        return _BLANKS.match(text, i).end()

    i = skip(0)
    if not text[i:i + 7].upper() == "EXPLAIN":
        return None
    i = skip(i + 7)
    if (m := re.match(r"ANALY[SZ]E\b", text[i:], re.I)) is not None:
        i = skip(i + m.end())
    if text[i:i + 1] == "(":
        close = text.find(")", i)
        if close < 0:
            return None
        i = skip(close + 1)
    return text[i:]


def _intervals_as_text(rel):
    """INTERVAL values as DuckDB writes them (`1 month 2 days`): Python's timedelta, the value
    DuckDB hands over, has no months and prints `30 days, 0:00:00`. A column is cast to text; a
    list, struct or map holding intervals comes as DuckDB's JSON of it (decoded for `--format json`).
    Returns the relation and the positions of the JSON columns."""
    kinds = [str(t) for t in rel.types]
    if not any("INTERVAL" in k for k in kinds):
        return rel, set()
    quoted = ['"' + c.replace('"', '""') + '"' for c in rel.columns]
    exprs, nested = [], set()
    for i, (q, k) in enumerate(zip(quoted, kinds)):
        if k == "INTERVAL":
            exprs.append(f"CAST(#{i + 1} AS VARCHAR) AS {q}")
        elif "INTERVAL" in k:
            exprs.append(f"to_json(#{i + 1}) AS {q}")
            nested.add(i)
        else:
            exprs.append(f"#{i + 1} AS {q}")
    return rel.project(", ".join(exprs)), nested


def _stream(result, fmt: str, nested: set[int] = frozenset()) -> None:
    """Write the rows as they come, in batches: an export of millions of rows never holds
    them all in memory. `nested`: columns that hold JSON text (CSV writes it as it is)."""
    import orjson

    cols = [d[0] for d in result.description]
    keys = _unique(cols)
    out = sys.stdout
    if fmt == "csv":
        out.write(",".join(_csv_field(c) for c in keys) + "\n")  # a header that repeats a name reads back as one
    while batch := result.fetchmany(10_000):
        if fmt == "csv":
            out.write("".join(",".join(_csv_field(v) for v in row) + "\n" for row in batch))
        else:
            if nested:
                batch = [[_decoded(v) if i in nested else v for i, v in enumerate(row)] for row in batch]
            out.write("".join(_json(dict(zip(keys, row))) + "\n" for row in batch))


def _decoded(text: str | None):
    """JSON text as its value, to be written again by orjson: a number no float holds exactly
    (30 digits, 1e400) stays as written, where orjson's own reader rounds it or refuses it."""
    import json
    import math

    import orjson

    if text is None:
        return None
    try:
        return json.loads(text, parse_int=lambda t: int(t) if len(t) <= 18 else orjson.Fragment(t),
                          parse_float=lambda t: float(t) if math.isfinite(float(t)) else orjson.Fragment(t))
    except ValueError:
        return text


def _blob_text(value: bytes) -> str:
    """A BLOB as DuckDB writes it (printable ASCII, other bytes as \\xHH), not Python's b'...'."""
    return "".join(chr(c) if 32 <= c < 127 and c != 92 else f"\\x{c:02X}" for c in value)


def _unique(names: list[str]) -> list[str]:
    """The names made unique as DuckDB makes them (`x`, `x_1`, `x_1_1`; case-insensitively, as it
    compares names): a JSON object keeps one value per key, so `SELECT 1 AS x, 2 AS x` lost a column."""
    taken: dict[str, int] = {}  # a lower-cased name -> the next suffix to try for it
    out = []
    for name in names:
        unique = name
        while unique.lower() in taken:
            n = taken[name.lower()]
            taken[name.lower()] = n + 1
            unique = f"{name}_{n}"
        taken[unique.lower()] = 1
        out.append(unique)
    return out


def _csv_field(value) -> str:
    """One CSV field: NULL is empty and the empty string is "", so the two stay apart;
    booleans are true/false, as DuckDB and most readers write them; lists, structs and
    maps are JSON text."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict, tuple)):
        value = _json(value)
    text = _blob_text(value) if isinstance(value, bytes) else str(value)
    if text == "" or any(c in text for c in ',"\n\r') or text != text.strip():
        return '"' + text.replace('"', '""') + '"'
    return text


def _json(value) -> str:
    """JSON for a row or a nested value: MAP keys need not be strings, and DECIMAL,
    UUID and INTERVAL values are written as their text."""
    import orjson

    return orjson.dumps(value, default=lambda v: _blob_text(v) if isinstance(v, bytes) else str(v),
                        option=orjson.OPT_NON_STR_KEYS).decode()
