"""Where a run's outputs live, and the DuckDB catalog over all runs.

data/runs/<run_id>/
  manifest.json          inputs, configuration, status
  plans.parquet          one row per sampled plan
  traces.parquet         one row per step
  results.parquet        one row per plan
  rewards.parquet        one row per plan, graded
  summary.json           the printed summary, as data
  work/                  the journal the run resumes from (safe to delete once complete)
  records.parquet        enrichment jobs: one typed record per input row (conductor.enrich)
data/conductor.duckdb    views plans, traces, results, rewards, runs over every run's files,
                         and one view per enrichment job: its newest run's records. A column
                         carried over from the query sets whose type differs between runs is
                         VARCHAR in its view (lists, structs and maps as JSON text)
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import re
import shlex
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import duckdb
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from conductor import schemas
from conductor.errors import ConductorError
from conductor.viewsql import MANIFEST_FIELDS, column_clash, runs_view, sql_type, text_groups, union_by_name

CATALOG = "conductor.duckdb"
# A journal line holds a step's whole answer (call.MAX_ANSWER_CHARS, JSON-escaped);
# DuckDB's default of 16 MB per line refused a long one and stopped the run for good.
MAX_LINE_BYTES = 256 << 20


def check_data_dir(data_dir: str | Path) -> None:
    """`--data-dir`, before anything is made under it (`conductor job run` took its lock first: a
    regular file ended in a NotADirectoryError traceback, and a path DuckDB reads as a pattern was
    refused only after .locks/ and runs/ were made in it)."""
    for folder in (Path(data_dir), *Path(data_dir).parents):  # afile/sub: its parent is the file
        if folder.exists() and not folder.is_dir():
            raise ConductorError(f"--data-dir {data_dir}: {'' if folder == Path(data_dir) else f'{folder} '}is "
                                 f"a file; give a folder (created if missing)")
    if any(c in str(Path(data_dir).resolve()) for c in "[]*?"):
        raise ConductorError(f"--data-dir {data_dir}: the path contains one of [ ] * ?, which DuckDB reads as "
                             f"a file pattern, so the run's files could not be read back; use a folder without them")


class RunDir:
    def __init__(self, data_dir: str | Path, run_id: str):
        self.data_dir = Path(data_dir).resolve()
        self.run_id = run_id
        self.path = self.data_dir / "runs" / run_id
        self.work = self.path / "work"

    def table(self, name: str) -> Path:
        return self.path / f"{name}.parquet"

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def read_manifest(self) -> dict[str, Any]:
        """The run's manifest; a damaged one (cut short, overwritten) is named with what to do,
        where it ended `conductor run` in a traceback."""
        try:
            return load_manifest(self.manifest_path)
        except ValueError as e:
            raise ConductorError(f"run {self.run_id}: its manifest {self.manifest_path} is damaged ({e}); "
                                 f"{damage_advice(self.manifest_path)}") from None

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        manifest["updated_at"] = _now()
        write_atomic(self.manifest_path, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))

    def set_status(self, status: str, drop: tuple[str, ...] = (), **extra: Any) -> None:
        """`drop`: keys an earlier status left that no longer hold."""
        m = self.read_manifest()
        for key in drop:
            m.pop(key, None)
        m["status"] = status
        m.update(extra)
        self.write_manifest(m)

    def update(self, **extra: Any) -> None:
        """Keys of the manifest written, its status as it is (a running stage's spend so far)."""
        m = self.read_manifest()
        m.update(extra)
        self.write_manifest(m)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary name beside `path`, renamed onto it once the write under it ends: readers
    never see half a file. An interrupted write removes its file, and a finished one removes
    those that killed processes left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = stale.name[len(path.name) + 2:-len(".tmp")]
        if pid.isdigit() and process_gone(int(pid)):
            stale.unlink(missing_ok=True)


def process_gone(pid: int) -> bool:
    """Whether the process has exited (or is a zombie: killed, not yet reaped by its parent);
    another user's process counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def write_atomic(path: Path, data: bytes) -> None:
    with replacing(path) as tmp:
        tmp.write_bytes(data)


def write_table(path: Path, table: pa.Table) -> None:
    """Write zstd Parquet under a temporary name, then rename."""
    with replacing(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def load_manifest(path: Path) -> dict[str, Any]:
    """A manifest.json as a dict; ValueError saying why when it is not a JSON object."""
    try:
        manifest = orjson.loads(Path(path).read_bytes())
    except orjson.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise ValueError("not a JSON object")
    return manifest


def damage_advice(path: Path) -> str:
    """What to do about a damaged file of a run folder: rerun the run where the rerun rewrites
    the file, else move the folder out of runs/ (renamed inside it, it is still read)."""
    path = Path(path)
    folder = path.parent
    aside = folder.parent.parent / "damaged"
    away = (f"move the run folder out of {folder.parent} "
            f"(mkdir -p {shlex.quote(str(aside))} && mv {shlex.quote(str(folder))} {shlex.quote(str(aside))}/)")
    rerun = f"rerun the `conductor run` command that made run {folder.name}, with --run-id {folder.name}"
    # A job run (conductor.enrich) is not resumed by its id: each `conductor job run` makes a new one
    job = (folder / "queries.parquet").exists() or (folder / "records.parquet").exists()
    if path.name == "rewards.parquet" and not job:
        return f"{rerun}: it grades the run again and rewrites the file; or {away}"
    if path.name in ("traces.parquet", "results.parquet") and not job and (folder / "work" / "steps.jsonl").exists():
        return f"{rerun}: it rewrites the file from the run's work/ journal and pays for nothing again; or {away}"
    return (f"{away}; rerunning the command that made the run then makes it again (answers in the response "
            f"cache are not paid again)")


_RUN_FILE = re.compile(r"""['"]((?:[^'"]*/)?runs/[^/'"]+/[^/'"]+\.(?:parquet|json))['"]""")


def damaged_file_advice(message: str) -> str | None:
    """For a DuckDB error naming a file of a run folder: which file, and what to do. A file whose
    footer reads is not called damaged: two runs whose column differs in type (BIGINT in one,
    BIGINT[] in the other) are named with both types. None when the message names no such file."""
    found = _RUN_FILE.search(message)
    if found is None:
        return None
    path = Path(found.group(1))
    why = file_damage(path)
    if why is not None or not path.exists():
        return f"{path} is damaged or not readable; {damage_advice(path)}"
    if path.suffix == ".parquet" and (clash := type_clash(path, message)) is not None:
        return clash
    reader = "read_json" if path.suffix == ".json" else "read_parquet"
    return (f"{path} did not read alongside the other runs' files, though its "
            f"{'JSON' if path.suffix == '.json' else 'footer'} reads; check it alone with "
            f"`conductor sql \"SELECT count(*) FROM {reader}({_q(path)})\"`: if that fails too, the file is "
            f"damaged: {damage_advice(path)}")


# DuckDB's `failed to cast column "x" from type A to B` and `the column "x" has type A, but we are
# trying to read it as type B`
_CAST_COLUMN = re.compile(r"""column ["']([^"']+)["'] (?:from type|has type) (.+?)"""
                          r"""(?: to |, but we are trying to read it as type )(.+?)(?:[:.]\s|[:.]?$)""", re.M)


def type_clash(path: Path, message: str) -> str | None:
    """The column DuckDB's error could not cast, its type in `path` and in another run's file of
    the same table, or None when the message names no column or no other run has another type."""
    found = _CAST_COLUMN.search(message)
    if found is None:
        return None
    column, wanted = found.group(1), found.group(3).strip()
    here = _column_type(path, column)
    others = []
    for f in catalog_files(path.parent.parent).get(path.stem, []):
        if f != path and (t := _column_type(f, column)) not in (None, "NULL", here):
            others.append((t != wanted, f, t))  # the type DuckDB wanted first: the file it took it from
    if here is None or not others:
        return None
    _, other, theirs = min(others)
    if column.lower() in {c.lower() for c in schemas.TABLES.get(path.stem, pa.schema([])).names}:
        todo = (f"a column of the schema differs only between files written by different conductor versions: "
                f"read each run's file apart, e.g. SELECT * FROM read_parquet({_q(path)})")
    else:
        todo = (f"the catalog's view {path.stem} reads a carried-over query-set column whose type differs "
                f"between runs as text (VARCHAR): query the view (`conductor sql` refreshes it first), or read "
                f"the runs' files apart")
    return (f"column {column} is {here} in run {path.parent.name} ({path}) and {theirs} in run {other.parent.name} "
            f"({other}); neither file is damaged: DuckDB cannot read the column as one type across the runs; "
            f"{todo}")


def schema_clashes(runs: Path, message: str, shown: int = 5) -> str | None:
    """For DuckDB's `Unimplemented type for cast (A -> B)`, which names no file: the columns of the
    schema that are A in one run's file and B in another's (written by different conductor
    versions), with both runs; None when there is none. Carried-over columns are text in the views."""
    cast = re.search(r"Unimplemented type for cast \((.+?) -> (.+?)\)", message)
    if cast is None:
        return None
    found = []
    for name, files in catalog_files(runs).items():
        if name not in schemas.TABLES:
            continue
        seen: dict[str, dict[str, Path]] = {}  # a column -> its type -> the first file of that type
        for f in files:
            try:
                schema = footer_schema(f)
            except (OSError, ValueError, pa.ArrowException):
                continue
            for i, col in enumerate(schema.names):
                if col in schemas.TABLES[name].names:
                    seen.setdefault(col, {}).setdefault(sql_type(schema.field(i).type), f)
        for col, kinds in seen.items():
            if set(cast.groups()) <= set(kinds):
                (a, fa), (b, fb) = [(t, kinds[t]) for t in cast.groups()]
                found.append(column_clash(col, name, (a, fa.parent.name, fa), (b, fb.parent.name, fb)))
    if not found:
        return None
    more = f"; and {len(found) - shown} more" if len(found) > shown else ""
    return ("; ".join(found[:shown]) + more + ": neither file is damaged (files written by different conductor "
            "versions may differ so), but DuckDB cannot read the column as one type across the runs; read each "
            "run's file apart (SELECT * FROM read_parquet('<file>'))")


def _column_type(path: Path, column: str) -> str | None:
    try:
        schema = footer_schema(path)
    except (OSError, ValueError, pa.ArrowException):
        return None
    for field in schema:
        if field.name.lower() == column.lower():
            return sql_type(field.type)
    return None


def file_damage(path: Path) -> str | None:
    """Why a run's Parquet file (its footer only, not its data) or manifest does not read; None if it does."""
    try:
        if path.suffix == ".json":
            load_manifest(path)
        else:
            footer_schema(path)
    except (OSError, ValueError, pa.ArrowException) as e:
        return (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
    return None


def footer_schema(path: Path) -> pa.Schema:
    """The schema in a Parquet file's footer (raising as pyarrow does when it does not read). Kept
    per file, size and time: the catalog checks a footer and then reads its column types."""
    st = os.stat(path)
    return _footer_schema(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8192)
def _footer_schema(path: str, size: int, mtime_ns: int) -> pa.Schema:
    return pq.read_metadata(path).schema.to_arrow_schema()


def rows_to_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)


def finalize_journal(run: RunDir) -> None:
    """Turn the journal into traces.parquet and results.parquet: the latest line
    per step and per plan wins, rows sorted by query then sample then step.
    DuckDB streams and spills, so memory stays bounded for large runs."""
    from conductor.execute.journal import PLANS_FILE, STEPS_FILE

    steps_cols = {**schemas.RECORDS["traces"].duckdb_types(), "_seq": "BIGINT"}
    plan_cols = {**schemas.PLAN_LINE.duckdb_types(), "_seq": "BIGINT"}
    for name in (STEPS_FILE, PLANS_FILE):
        (run.work / name).touch()
    con = _scratch(run)
    try:
        # A step tried again (a rerun, --retry-failed) keeps its latest row, charged what every try of it
        # was billed: a refused or invalid answer before is paid all the same. `_unpriced`: some try was
        # a billed call of unknown price, so the sum is unknown too (null).
        con.execute(f"""
            CREATE TEMP VIEW steps AS
            SELECT * EXCLUDE (_seq, _paid) REPLACE (CASE WHEN _unpriced THEN NULL ELSE _paid END AS cost_usd)
            FROM (SELECT *, sum(cost_usd) OVER w AS _paid,
                         bool_or(cost_usd IS NULL AND attempts > 0 AND (status = 'ok' OR prompt_tokens IS NOT NULL))
                             OVER w AS _unpriced
                  FROM read_json({_q(run.work / STEPS_FILE)}, format='newline_delimited',
                                 maximum_object_size={MAX_LINE_BYTES}, columns={_struct(steps_cols)},
                                 ignore_errors=true)
                  WINDOW w AS (PARTITION BY plan_id, step_path))
            QUALIFY row_number() OVER (PARTITION BY plan_id, step_path ORDER BY _seq DESC) = 1""")
        con.execute(f"""
            CREATE TEMP VIEW plan_rows AS
            SELECT * EXCLUDE (_seq) FROM read_json({_q(run.work / PLANS_FILE)}, format='newline_delimited',
                maximum_object_size={MAX_LINE_BYTES},
                columns={_struct(plan_cols)}, ignore_errors=true)
            QUALIFY row_number() OVER (PARTITION BY plan_id ORDER BY _seq DESC) = 1""")
        _copy(con, "SELECT * EXCLUDE (_unpriced) FROM steps ORDER BY query_index, sample, step_path",
              run.table("traces"))
        _copy(con, """
            SELECT p.run_id, p.plan_id, p.query_id, p.query_index, p.sample, p.status, p.final_answer, p.error,
                   CASE WHEN coalesce(s.unpriced, 0) > 0 THEN NULL ELSE coalesce(s.cost_usd, 0) END AS cost_usd,
                   coalesce(s.prompt_tokens, 0) AS prompt_tokens,
                   coalesce(s.completion_tokens, 0) AS completion_tokens,
                   coalesce(s.calls, 0)::INTEGER AS calls, coalesce(s.cache_hits, 0)::INTEGER AS cache_hits,
                   p.wall_time_s, p.started_at, p.ended_at
            FROM plan_rows p LEFT JOIN (
                SELECT plan_id, sum(cost_usd) AS cost_usd, count(*) FILTER (WHERE _unpriced) AS unpriced,
                       sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens,
                       count(*) FILTER (WHERE attempts > 0) AS calls,
                       count(*) FILTER (WHERE cache_hit) AS cache_hits
                FROM steps GROUP BY plan_id) s USING (plan_id)
            ORDER BY p.query_index, p.sample""", run.table("results"))
    finally:
        con.close()
    _check_schema(run.table("traces"), schemas.TRACES)
    _check_schema(run.table("results"), schemas.RESULTS)


def _scratch(run: RunDir) -> duckdb.DuckDBPyConnection:
    tmp = run.work / "duckdb_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(":memory:")
    con.execute(f"SET temp_directory = {_q(tmp)}")
    # The window that keeps each step's newest journal line does not spill well: 512 MB ran out
    # on a 91k-plan sweep (270k steps). Spilling still goes to temp_directory past this.
    con.execute("SET memory_limit = '3GB'")
    con.execute("SET preserve_insertion_order = false")
    con.execute("SET TimeZone = 'UTC'")
    return con


def _copy(con: duckdb.DuckDBPyConnection, query: str, path: Path) -> None:
    with replacing(path) as tmp:
        con.execute(f"COPY ({query}) TO {_q(tmp)} (FORMAT parquet, COMPRESSION zstd)")


def _check_schema(path: Path, schema: pa.Schema) -> None:
    """Cast what DuckDB wrote to the declared schema (it may pick other widths)."""
    table = pq.read_table(path)
    if table.schema.equals(schema):
        return
    table = table.select(schema.names).cast(schema)
    write_table(path, table)


def refresh_catalog(data_dir: str | Path, attempts: int = 20, warn: Callable[[str], None] | None = None) -> Path:
    """(Re)create the catalog's views over every run's Parquet files. The catalog
    holds no data, so rebuilding it is always safe. Damaged files are left out and
    `warn` (default: standard error) names them."""
    data_dir = Path(data_dir).resolve()
    db = data_dir / CATALOG
    runs = data_dir / "runs"
    data_dir.mkdir(parents=True, exist_ok=True)  # a new data folder has an empty catalog, not an error
    last: Exception | None = None
    for i in range(attempts):
        try:
            con = duckdb.connect(str(db))
            break
        except duckdb.IOException as e:  # another process holds the file
            if "lock" not in str(e).lower():  # not held: damaged, or not a database at all
                raise ConductorError(f"cannot open {db} ({e}); it holds no data, only views over the runs' "
                                     f"files: delete it, and the next run or `conductor sql` rebuilds it") from None
            last = e
            time.sleep(0.25 * (i + 1))
    else:
        raise CatalogHeld(f"cannot open {db}: {last}")
    # Taken before the views are made: files landing meanwhile make the stamp stale (so the next
    # `conductor sql` refreshes), never a stamp newer than the views
    signature = views_signature(data_dir)
    try:
        elsewhere = _views_elsewhere(con, runs)
        left_out = create_views(con, runs, warn)
    except duckdb.Error as e:  # a file under runs/ whose footer reads but whose schema does not: name it
        advice = damaged_file_advice(str(e)) or "move the damaged file away and rerun `conductor sql`"
        raise ConductorError(f"the catalog {db} cannot read the runs' files ({e}); {advice}") from None
    finally:
        con.close()
    if elsewhere:
        (warn or _warn)(f"the catalog's views read the runs under {', '.join(map(str, elsewhere))} (this data "
                        f"folder was copied or moved from there); they read {runs} from now on. Another DuckDB "
                        f"client reads the folder the views name: run `conductor sql` once after a copy or move")
    try:
        if left_out:  # no stamp: every `conductor sql` checks again and says so, until the files are fixed
            (data_dir / VIEWS_STAMP).unlink(missing_ok=True)
        else:
            (data_dir / VIEWS_STAMP).write_text(signature)
    except OSError:
        pass  # only an optimization: `conductor sql` refreshes again next time
    return db


_VIEW_FILE = re.compile(r"'((?:[^']|'')+)/[^/']+/[^/']+\.(?:parquet|json)'")


def _views_elsewhere(con: duckdb.DuckDBPyConnection, runs: Path) -> list[str]:
    """The runs folders, other than `runs`, that the catalog's views read: the views name files by
    absolute path, so a data folder copied or moved keeps reading the old one until refreshed."""
    views = con.execute("SELECT sql FROM duckdb_views() WHERE NOT internal AND schema_name = 'main' "
                        "AND database_name = current_database()").fetchall()
    found = {m.group(1).replace("''", "'") for (sql,) in views for m in _VIEW_FILE.finditer(sql or "")}
    return sorted(f for f in found if Path(f) != runs)


class CatalogHeld(ConductorError):
    """Another process holds the catalog file: a run's outputs are complete all the same."""


VIEWS_STAMP = ".conductor.duckdb.views"  # which views the catalog holds, so `conductor sql` refreshes only on change
VIEWS_SHAPE = 4  # raised whenever the views' queries change (2: the runs view's spent_usd, spend, ...; 3: error;
#                   4: settings)


def views_signature(data_dir: Path) -> str:
    """The views the catalog should hold: the tables that have files, the files with their size
    and time (a new or rewritten file is checked once, the first time `conductor sql` sees it),
    and the enrichment jobs."""
    runs = Path(data_dir).resolve() / "runs"
    files = catalog_files(runs)
    listing = "\n".join(f"{f} {_stat(f)}" for fs in files.values() for f in fs)
    # The views name files by absolute path: a data folder copied or moved must rebuild them. The
    # queries' shape too: a catalog made by an older conductor gets the columns this one adds.
    return orjson.dumps({"root": str(runs), "shape": VIEWS_SHAPE, "views": [n for n, fs in files.items() if fs],
                         "files": hashlib.sha256(listing.encode()).hexdigest(), "jobs": job_runs(runs)},
                        default=str, option=orjson.OPT_SORT_KEYS).decode()


def _stat(path: Path) -> str:
    try:
        st = os.stat(path)
    except FileNotFoundError:  # a run folder deleted meanwhile
        return "gone"
    return f"{st.st_size} {st.st_mtime_ns}"


def catalog_is_current(data_dir: Path) -> bool:
    data_dir = Path(data_dir).resolve()
    stamp = data_dir / VIEWS_STAMP
    return (data_dir / CATALOG).exists() and stamp.exists() and stamp.read_text() == views_signature(data_dir)


def catalog_files(runs: Path) -> dict[str, list[Path]]:
    """The files of each view: every run's table, and its manifest for `runs` (os.scandir: every
    `conductor sql` lists them, and pathlib's glob took 10 times as long)."""
    view_of = {f"{name}.parquet": name for name in schemas.TABLES} | {"manifest.json": "runs"}
    files: dict[str, list[str]] = {name: [] for name in view_of.values()}
    try:
        folders = [e.path for e in os.scandir(runs) if e.is_dir()]
    except FileNotFoundError:
        folders = []
    for folder in folders:
        try:
            with os.scandir(folder) as entries:
                for e in entries:
                    if e.name in view_of and e.is_file():
                        files[view_of[e.name]].append(e.path)
        except (FileNotFoundError, NotADirectoryError):  # deleted meanwhile
            continue
    return {name: [Path(f) for f in sorted(fs)] for name, fs in files.items()}


def create_views(con: duckdb.DuckDBPyConnection, runs: Path, warn: Callable[[str], None] | None = None) -> list[Path]:
    """The catalog's views over every run's files, in `con` (the catalog file, or memory).

    One damaged file made its whole view fail, for every run: a file whose Parquet footer (or
    manifest) does not read is left out, and `warn` (default: standard error) names it and what
    to do. Returns the files left out."""
    con.execute("SET TimeZone = 'UTC'")
    left_out: list[tuple[Path, str]] = []
    for name, files in catalog_files(runs).items():
        good = []
        for f in files:
            why = file_damage(f)
            if why is None:
                good.append(f)
            elif f.exists():  # not a run folder deleted meanwhile
                left_out.append((f, why))
        if not good:
            con.execute(f"DROP VIEW IF EXISTS {name}")
            continue
        if name == "runs":
            # The pattern while every file reads, so other DuckDB clients see new runs without a refresh
            source = _q(runs / "*" / files[0].name) if len(good) == len(files) else _list(good)
            con.execute(f"""CREATE OR REPLACE VIEW runs AS {runs_view(
                f"read_json({source}, format='auto', union_by_name=true, columns={_struct(MANIFEST_FIELDS)})")}""")
        else:
            con.execute(f"CREATE OR REPLACE VIEW {name} AS {_table_view(name, runs, files, good)}")
    left_out += _job_views(con, runs)
    if left_out:
        (warn or _warn)(left_out_note(left_out))
    return [f for f, _ in left_out]


def _table_view(name: str, runs: Path, files: list[Path], good: list[Path]) -> str:
    """The query of a table's view over its readable files `good` (of `files`); see text_groups."""
    groups = text_groups(name, {f: footer_schema(f) for f in good})
    if groups is None:
        # The pattern while every file reads, so other DuckDB clients see new runs without a refresh
        source = _q(runs / "*" / files[0].name) if len(good) == len(files) else _list(good)
        return f"SELECT * FROM read_parquet({source}, union_by_name = true)"
    return union_by_name([(f"read_parquet({_list(fs)}, union_by_name = true)", texts) for fs, texts in groups])


def _list(files: list[Path]) -> str:
    return "[" + ", ".join(_q(f) for f in files) + "]"


def left_out_note(left_out: list[tuple[Path, str]], shown: int = 10) -> str:
    """Which damaged files the catalog left out, why, and what to do about each."""
    lines = [f"  {f} ({why}): {damage_advice(f)}" for f, why in left_out[:shown]]
    if len(left_out) > shown:
        lines.append(f"  and {len(left_out) - shown} more")
    return (f"the catalog leaves out {len(left_out)} damaged file(s), so the views lack their runs' rows "
            f"until each is fixed:\n" + "\n".join(lines))


def _warn(note: str) -> None:
    print(f"conductor: {note}", file=sys.stderr)


def job_runs(runs: Path) -> dict[str, dict[str, Any]]:
    """Enrichment jobs found in run manifests: name -> {id_column, files: [the newest run's
    records.parquet]}. Each run's records hold every row of its input (reused rows copied),
    so the newest run is the job's current state: a row removed from the input leaves it,
    and a view over it reads one file however many runs are kept."""
    jobs: dict[str, dict[str, Any]] = {}
    manifests = sorted(runs.glob("*/manifest.json")) if runs.exists() else []
    for m in manifests:
        if not (m.parent / "records.parquet").exists():
            continue
        try:
            manifest = load_manifest(m)
        except (OSError, ValueError):  # left out of the runs view, and named, by create_views
            continue
        job = manifest.get("job")
        if not isinstance(job, dict) or not job.get("name"):
            continue
        entry = jobs.setdefault(job["name"], {"id_column": None, "files": []})
        entry["files"].append((str(manifest.get("created_at") or ""), str(m.parent / "records.parquet"),
                               job.get("definition"), job.get("id_column")))
    for entry in jobs.values():
        newest = max(entry["files"])
        entry["id_column"] = newest[3]
        entry["files"] = [newest[1]]
    return jobs


def _job_views(con: duckdb.DuckDBPyConnection, runs: Path) -> list[tuple[Path, str]]:
    """One view per enrichment job: the records of its newest run. A job whose newest records
    are damaged gets none (its older runs' would pass for today's); returns those files. A job
    with no run left (its folders deleted) loses its view, as `plans` does when no run has one:
    kept, it read files that are gone, and `conductor sql` called them damaged."""
    left_out = []
    jobs = job_runs(runs)
    for name in _stale_job_views(con, set(jobs)):
        con.execute(f'DROP VIEW IF EXISTS "{name}"')
    for name, entry in jobs.items():
        if name in schemas.TABLES or name == "runs" or not entry["id_column"]:
            continue
        damaged = [(Path(f), why) for f in entry["files"] if (why := file_damage(Path(f))) is not None]
        if damaged:
            left_out += damaged
            con.execute(f'DROP VIEW IF EXISTS "{name}"')
            continue
        files = "[" + ", ".join(_q(f) for f in entry["files"]) + "]"
        con.execute(f"""CREATE OR REPLACE VIEW "{name}" AS SELECT * FROM read_parquet({files})""")
    return left_out


def _stale_job_views(con: duckdb.DuckDBPyConnection, jobs: set[str]) -> list[str]:
    """The catalog's job views (those reading a run's records.parquet) of jobs no longer in `jobs`."""
    views = con.execute("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal AND schema_name = 'main' "
                        "AND database_name = current_database()").fetchall()
    return [name for name, sql in views
            if name not in jobs and name not in schemas.TABLES and name != "runs" and "/records.parquet'" in sql]


def _q(path: Path | str) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def _struct(cols: dict[str, str]) -> str:
    return "{" + ", ".join(f"{_q(k)}: {_q(v)}" for k, v in cols.items()) + "}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()
