"""A job's input table: Parquet, CSV or JSON Lines (by extension; a .json file may
also hold one JSON array of objects), one file or a folder of them, left-joined
with lookup tables. Read with polars.

Values reach prompts and row hashes as they were written, so that a grown file
does not change its old rows: CSV columns are read as text (no type inference:
`00501` stays `00501`, and one `1.5` appended to a column of `7`s leaves the 7s
alone), and where polars reads a JSON column holding 7 and 2.5 as floats, the
values written as integers are kept beside it (`as_written`), so 7 renders `7`,
not `7.0`. Parquet has types of its own and is read as it is."""

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


# Beside a JSON column read as floats: its values written as integers (null for the others).
_INT = "\0int:"


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
    """The table, with the `as_written` integers of a JSON input's float columns beside them."""
    try:
        df = scan(path).collect()
    except InputError:
        raise
    except Exception as e:
        raise _unreadable(path, input_files(path), e) from None
    files = input_files(path)
    return _json_integers(files, df) if FORMATS[files[0].suffix.lower()] == "ndjson" else df


def as_written(df: pl.DataFrame, name: str) -> list[Any]:
    """A column's values for prompts and hashes: a JSON float column's integers as integers."""
    values = df.get_column(name).to_list()
    if _INT + name not in df.columns:
        return values
    return [v if i is None else i for v, i in zip(values, df.get_column(_INT + name).to_list())]


def kept_columns(right: pl.DataFrame, left: list[str]) -> list[str]:
    """The columns a join takes from `right` (those `left` lacks), with what `as_written` needs of them."""
    kept = [c for c in right.columns if c not in left and not c.startswith(_INT)]
    return kept + [_INT + c for c in kept if _INT + c in right.columns]


def _json_integers(files: list[Path], df: pl.DataFrame) -> pl.DataFrame:
    """polars reads a JSON column holding 7 and 2.5 (in one file, or in two files of a folder) as
    floats, and 7 would become 7.0 in prompts and hashes once 2.5 arrives: every row changed, sent
    and paid again. Keep the integers as written beside such a column. Rows that cannot be told
    apart (a line orjson cannot read) leave the table as polars read it."""
    floats = [c for c, t in df.schema.items() if t.is_float()]
    if not floats:
        return df
    try:
        rows = [r for f in files for r in _json_values(f, floats)]
    except (OSError, orjson.JSONDecodeError):
        return df
    if len(rows) != df.height:
        return df
    extra = []
    for k, c in enumerate(floats):
        ints = [v if type(v) is int and -2**63 <= v < 2**63 else None for v in (r[k] for r in rows)]
        if any(v is not None for v in ints):
            extra.append(pl.Series(_INT + c, ints, pl.Int64))
    return df.with_columns(extra) if extra else df


def _json_values(f: Path, names: list[str]) -> list[tuple]:
    """Per object of a JSON Lines file (blank lines skipped, as polars does) or of a JSON array,
    the values of `names` as JSON wrote them (7 an int, 7.0 a float)."""
    data = f.read_bytes()
    objects = orjson.loads(data) if _json_array(f) else (orjson.loads(line) for line in data.splitlines()
                                                          if line.strip())
    return [tuple(o.get(n) for n in names) if isinstance(o, dict) else (None,) * len(names) for o in objects]


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
