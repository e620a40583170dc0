"""A job's input table: Parquet, CSV or JSON Lines (by extension; a .json file may
also hold one JSON array of objects), one file or a folder of them, left-joined
with lookup tables. Read with polars.

Values reach prompts and row hashes as they were written, so that a grown file
does not change its old rows: CSV columns are read as text (no type inference:
`00501` stays `00501`, and one `1.5` appended to a column of `7`s leaves the 7s
alone). polars reads JSON into one type per column, which a later row can change for
every earlier one: 7 becomes 7.0 once 2.5 arrives, true becomes "true" once a string
does, and an object gains every key any row has (`'region': None`). So each value
polars changed is kept beside its column as JSON wrote it (`as_written`). Parquet has
types of its own and is read as it is."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from conductor.errors import InputError

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "ndjson", ".ndjson": "ndjson",
           ".json": "ndjson"}


def input_files(path: Path) -> list[Path]:
    """The files of an input: the file itself, or every readable file of a folder, sorted."""
    if not path.exists():
        raise InputError(f"input {path}: not found")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FORMATS)
        if not files:
            raise InputError(f"input {path}: folder holds no .parquet, .csv or .jsonl file")
        kinds = {FORMATS[p.suffix.lower()] for p in files}
        if len(kinds) > 1:
            raise InputError(f"input {path}: folder mixes formats ({', '.join(sorted(kinds))}); keep one")
        return files
    if path.suffix.lower() not in FORMATS:
        raise InputError(f"input {path}: unknown format {path.suffix!r} (use .parquet, .csv or .jsonl)")
    return [path]


# Beside a JSON column: the values polars changed, as JSON text of what the file holds (null: unchanged).
_RAW = "\0raw:"


def is_csv(path: Path) -> bool:
    """A CSV input (a file, or a folder of them): its columns are read as text."""
    files = input_files(path)
    return FORMATS[files[0].suffix.lower()] == "csv"


def scan(path: Path) -> pl.LazyFrame:
    """Every CSV column as text, exactly as written (an id such as 007, a code such as 00501)."""
    files = input_files(path)
    kind = FORMATS[files[0].suffix.lower()]
    try:
        if kind == "parquet":
            return pl.scan_parquet(files)
        if kind == "csv":
            return pl.concat([pl.scan_csv(f, infer_schema=False) for f in files], how="diagonal_relaxed")
        return pl.concat([pl.read_json(f).lazy() if _json_array(f) else pl.scan_ndjson(f) for f in files],
                         how="diagonal_relaxed")
    except Exception as e:  # polars raises several types for unreadable files
        raise _unreadable(path, files, e) from None


def columns(path: Path) -> list[str]:
    try:
        return list(scan(path).collect_schema().names())
    except InputError:
        raise
    except Exception as e:
        raise _unreadable(path, input_files(path), e, "cannot read its columns") from None


def read(path: Path) -> pl.DataFrame:
    """The table, with the `as_written` values of a JSON input's columns beside them."""
    try:
        df = scan(path).collect()
    except InputError:
        raise
    except Exception as e:
        raise _unreadable(path, input_files(path), e) from None
    files = input_files(path)
    return _json_as_written(files, df) if FORMATS[files[0].suffix.lower()] == "ndjson" else df


def as_written(df: pl.DataFrame, name: str) -> list[Any]:
    """A column's values for prompts and hashes, as the input wrote them."""
    values = df.get_column(name).to_list()
    if _RAW + name not in df.columns:
        return values
    return [v if r is None else orjson.loads(r) for v, r in zip(values, df.get_column(_RAW + name).to_list())]


def kept_columns(right: pl.DataFrame, left: list[str]) -> list[str]:
    """The columns a join takes from `right` (those `left` lacks), with what `as_written` needs of them."""
    kept = [c for c in right.columns if c not in left and not c.startswith(_RAW)]
    return kept + [_RAW + c for c in kept if _RAW + c in right.columns]


def _json_as_written(files: list[Path], df: pl.DataFrame) -> pl.DataFrame:
    """Beside each column, the values polars changed from what the file holds (see the module's
    docstring): a grown file changed its old rows' prompts and hashes, and every row was sent
    and paid again. Text is compared by type (a value that is not a string was made one), so
    are other scalars (7 made 7.0), objects and lists by their JSON. Rows that cannot be told
    apart (a line orjson cannot read) leave the table as polars read it."""
    texts = [c for c, t in df.schema.items() if t == pl.String]
    nested = {c: df.get_column(c).to_list() for c, t in df.schema.items()
              if isinstance(t, (pl.Struct, pl.List, pl.Array))}
    scalars = {c: df.get_column(c).to_list() for c in df.columns if c not in nested and c not in texts}
    changed: dict[str, dict[int, str]] = {c: {} for c in df.columns}
    i = -1
    try:
        for i, o in enumerate(o for f in files for o in _json_objects(f)):
            if i >= df.height or not isinstance(o, dict):
                return df
            for c in texts:
                v = o.get(c)
                if v is not None and type(v) is not str:
                    changed[c][i] = orjson.dumps(v).decode()
            for c, values in scalars.items():  # 7 made 7.0, true made 1; orjson reads 2**70 as a float
                v, read = o.get(c), values[i]
                if v is not None and read is not None and type(v) is not type(read) and \
                        not (type(v) is float and type(read) is int):
                    changed[c][i] = orjson.dumps(v).decode()
            for c, values in nested.items():
                v = o.get(c)
                if v is not None and (read := _json_text(values[i])) is not None and (raw := _json_text(v)) != read:
                    changed[c][i] = raw
    except (OSError, orjson.JSONDecodeError):
        return df
    if i + 1 != df.height:
        return df
    extra = [pl.Series(_RAW + c, [rows.get(k) for k in range(df.height)], pl.String)
             for c, rows in changed.items() if rows]
    return df.with_columns(extra) if extra else df


def _json_text(v: Any) -> str | None:
    """`v` as JSON, or None for what JSON cannot hold exactly (an integer past 64 bits, which
    orjson reads as a float and polars as a 128-bit integer: polars' value is kept)."""
    try:
        return orjson.dumps(v, default=str).decode()
    except TypeError:
        return None


def _json_objects(f: Path):
    """The objects of a JSON Lines file (blank lines skipped, as polars does) or of a JSON array."""
    data = f.read_bytes()
    return orjson.loads(data) if _json_array(f) else (orjson.loads(line) for line in data.splitlines()
                                                       if line.strip())


def _json_array(f: Path) -> bool:
    """A .json file holding one array of objects, not JSON Lines."""
    if f.suffix.lower() != ".json":
        return False
    with open(f, "rb") as fh:
        return fh.read(4096).lstrip().startswith(b"[")


def _unreadable(path: Path, files: list[Path], e: Exception, what: str = "cannot read") -> InputError:
    """The error for a file polars cannot read: for text that is not UTF-8, a CSV line with
    more fields than its header, or a JSON line cut off, the file and line. polars' own message
    names no line, and may advise an option of its own that a job file cannot set: only its
    first line is shown."""
    for f in files:
        if FORMATS[f.suffix.lower()] == "parquet":
            continue
        with open(f, "rb") as fh:
            for n, line in enumerate(fh, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError:
                    return InputError(f"input {f}: line {n} is not valid UTF-8; save the file as UTF-8 (for "
                                      f"example `iconv -f latin1 -t utf-8`)")
    for f in files:
        if (why := _bad_line(f)) is not None:
            return InputError(f"input {f}: {why}")
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return InputError(f"input {path}: {what} ({type(e).__name__}: {first})")


def _bad_line(f: Path) -> str | None:
    """The first line of a CSV or JSON file that polars cannot read, and why; None if none is found."""
    kind = FORMATS[f.suffix.lower()]
    try:
        if kind == "csv":
            with open(f, newline="", encoding="utf-8") as fh:
                rows = csv.reader(fh)
                header = next(rows, [])
                for row in rows:
                    if len(row) > len(header):
                        return (f"line {rows.line_num} has {len(row)} fields, the header {len(header)}: "
                                f"a separator or quote out of place?")
        elif _json_array(f):
            try:
                orjson.loads(f.read_bytes())
            except orjson.JSONDecodeError as e:
                return f"line {e.lineno} is not valid JSON ({e.msg})"
        else:
            for n, line in enumerate(f.read_bytes().splitlines(), 1):
                try:
                    if line.strip():
                        orjson.loads(line)
                except orjson.JSONDecodeError as e:
                    return f"line {n} is not valid JSON ({e.msg}); a line cut off, or two objects on one line?"
    except (OSError, UnicodeDecodeError, csv.Error):
        return None
    return None
