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
types of its own and is read as it is; the files of a Parquet folder may differ in columns (a
file without one gives its rows nulls there) and mix integers with decimals in a column (a
daily file that gains a 2.5), which polars reads as decimals: the integers' values are then
kept as written too (7, not 7.0), as for JSON. Other type differences are refused, naming the
column and both files."""

from __future__ import annotations

import csv
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from conductor.errors import InputError

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "ndjson", ".ndjson": "ndjson",
           ".json": "ndjson"}
_ACCEPTED = ", ".join(FORMATS)  # every extension read, for the messages that list them


def input_files(path: Path) -> list[Path]:
    """The files of an input: the file itself, or every readable file of a folder, sorted."""
    if not path.exists():
        raise InputError(f"input {path}: not found")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FORMATS)
        if not files:
            raise InputError(f"input {path}: folder holds no file of a known format ({_ACCEPTED})")
        kinds = {FORMATS[p.suffix.lower()] for p in files}
        if len(kinds) > 1:
            raise InputError(f"input {path}: folder mixes formats ({', '.join(sorted(kinds))}); keep one")
        return files
    if path.suffix.lower() not in FORMATS:
        raise InputError(f"input {path}: unknown format {path.suffix!r} (use one of {_ACCEPTED}; a .json file "
                         f"holds JSON Lines or one array of objects)")
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
            _parquet_schemas(path, files)
            if len(files) == 1:
                return pl.scan_parquet(files[0])
            return pl.concat([pl.scan_parquet(f) for f in files], how="diagonal_relaxed")
        if kind == "csv":
            for f in files:
                if (why := _csv_problem(f, header_only=True)) is not None:
                    raise InputError(f"input {f}: {why}")
            return pl.concat([pl.scan_csv(f, infer_schema=False) for f in files], how="diagonal_relaxed")
        for f in files:
            if (why := _json_problem(f)) is not None:
                raise InputError(f"input {f}: {why}")
        return pl.concat([pl.read_json(f).lazy() if _json_array(f) else pl.scan_ndjson(f) for f in files],
                         how="diagonal_relaxed")
    except InputError:
        raise
    except Exception as e:  # polars raises several types for unreadable files
        raise _unreadable(path, files, e) from None


def columns(path: Path) -> list[str]:
    try:
        return list(scan(path).collect_schema().names())
    except InputError:
        raise
    except Exception as e:
        raise _unreadable(path, input_files(path), e, "cannot read its columns") from None


def values_outside(path: Path, column: str, allowed: tuple[str, ...]) -> str | None:
    """What a text column holds besides nulls and `allowed`, for a message ("holds 'Million', 'm'",
    "holds Int64 values"); None when it holds nothing else. Reads that column's distinct values
    only, so a job can refuse a value its scorer would misread before any call."""
    try:
        s = scan(path).select(pl.col(column)).unique().collect().to_series()
    except InputError:
        raise
    except Exception as e:
        raise _unreadable(path, input_files(path), e, f"cannot read column {column!r}") from None
    if s.dtype == pl.Null:
        return None
    if isinstance(s.dtype, (pl.Categorical, pl.Enum)):
        s = s.cast(pl.String)
    if s.dtype != pl.String:
        return f"holds {s.dtype} values"
    odd = sorted(v for v in s.drop_nulls().to_list() if v not in allowed)
    if not odd:
        return None
    return "holds " + ", ".join(map(repr, odd[:5])) + (f" and {len(odd) - 5} more" if len(odd) > 5 else "")


def read(path: Path) -> pl.DataFrame:
    """The table, with the `as_written` values of a JSON input's columns, or of a Parquet
    folder's integers read as decimals, beside them."""
    files = input_files(path)
    kind = FORMATS[files[0].suffix.lower()]
    if kind == "parquet":
        return _read_parquet(path, files)
    if kind == "csv":  # polars reads a short line as nulls, and a repeated header name as `<name>_duplicated_0`
        for f in files:
            if (why := _csv_problem(f)) is not None:
                raise InputError(f"input {f}: {why}")
    try:
        df = scan(path).collect()
    except InputError:
        raise
    except Exception as e:
        raise _unreadable(path, files, e) from None
    return _json_as_written(files, df) if kind == "ndjson" else df


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


def _parquet_schemas(path: Path, files: list[Path]) -> list[dict[str, pl.DataType]]:
    """Each file's schema (its footer only): a file that is not Parquet is named, and so is a
    column whose type differs between two files in a way `_mixes` does not allow. polars' own
    error names neither file (`data type mismatch for column amount: incoming: Float64 != target:
    Int64`), and was reported as a JSON line that does not parse."""
    schemas = []
    for f in files:
        try:
            schemas.append(dict(pl.read_parquet_schema(f)))
        except Exception as e:  # polars raises ComputeError, OSError, ... for what is not Parquet
            raise _not_parquet(f, e) from None
    first: dict[str, tuple[pl.DataType, Path]] = {}
    for f, schema in zip(files, schemas):
        for c, t in schema.items():
            if c not in first or first[c][0] == pl.Null:
                first[c] = (t, f)
            elif not _mixes(first[c][0], t):
                t0, f0 = first[c]
                raise InputError(f"input {path}: column {c!r} is {t0} in {f0} but {t} in {f}; the files of a folder "
                                 f"must give each column one type (only integers and decimals may mix); write it "
                                 f"with one type in every file")
    return schemas


def _mixes(a: pl.DataType, b: pl.DataType) -> bool:
    """Two Parquet types one column may have in different files of a folder: the same, one all
    nulls, integers and decimals (read as the wider one), or lists of those."""
    if a == b or a == pl.Null or b == pl.Null:
        return True
    if (a.is_integer() or a.is_float()) and (b.is_integer() or b.is_float()):
        return True
    if isinstance(a, pl.List) and isinstance(b, pl.List):
        return _mixes(a.inner, b.inner)
    return False


def _keeps_values(src: pl.DataType, dst: pl.DataType) -> bool:
    """Whether values of type `src` read as `dst` keep their Python values (so their prompts
    and hashes): not integers made decimals (7 would render 7.0, and every old row of a folder
    be sent again once a file brings a 2.5), nor 128-bit integers (stored as text)."""
    if src == dst or src == pl.Null:
        return True
    if src.is_integer() and dst.is_integer():
        return dst not in (pl.Int128, pl.UInt128)
    if src.is_float() and dst.is_float():
        return True
    if isinstance(src, pl.List) and isinstance(dst, pl.List):
        return _keeps_values(src.inner, dst.inner)
    return False


def _read_parquet(path: Path, files: list[Path]) -> pl.DataFrame:
    """A Parquet file, or a folder's files one after the other (a column a file lacks is null
    there); where a column's type was widened for a file's values that it changes (integers
    read as decimals), those values as the file wrote them, beside it (see `as_written`)."""
    _parquet_schemas(path, files)
    frames = []
    for f in files:
        try:
            frames.append(pl.read_parquet(f))
        except Exception as e:  # a readable footer over damaged data
            raise _not_parquet(f, e) from None
    if len(frames) == 1:
        return frames[0]
    try:
        df = pl.concat(frames, how="diagonal_relaxed")
    except Exception as e:
        raise InputError(f"input {path}: cannot read its files together ({type(e).__name__}: {_first_line(e)})") \
            from None
    raw = []
    for c, target in df.schema.items():
        widened = [c in fr.columns and not _keeps_values(fr.schema[c], target) for fr in frames]
        if any(widened):
            values: list[str | None] = []
            for fr, w in zip(frames, widened):
                values += ([None if v is None else orjson.dumps(v).decode() for v in fr.get_column(c).to_list()]
                           if w else [None] * fr.height)
            raw.append(pl.Series(_RAW + c, values, pl.String))
    return df.with_columns(raw) if raw else df


def _not_parquet(f: Path, e: Exception) -> InputError:
    return InputError(f"input {f}: not a readable Parquet file ({type(e).__name__}: {_first_line(e)})")


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def _unreadable(path: Path, files: list[Path], e: Exception, what: str = "cannot read") -> InputError:
    """The error for a file polars cannot read: for text that is not UTF-8, a CSV line with
    more or fewer fields than its header, or a JSON line cut off, the file and line; for a file
    that is not Parquet, the file. polars' own message names no line, and may advise an option
    of its own that a job file cannot set: only its first line is shown."""
    for f in files:
        if FORMATS[f.suffix.lower()] == "parquet":
            try:
                pl.read_parquet_schema(f)
            except Exception as pe:
                return _not_parquet(f, pe)
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
    return InputError(f"input {path}: {what} ({type(e).__name__}: {_first_line(e)})")


def _bad_line(f: Path) -> str | None:
    """The first line of a CSV or JSON file that polars cannot read, and why; None if none is found
    (and for Parquet, which has no lines)."""
    kind = FORMATS[f.suffix.lower()]
    if kind == "parquet":
        return None
    if kind == "csv":
        return _csv_problem(f)
    try:
        if _json_array(f):
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
    except (OSError, UnicodeDecodeError):
        return None
    return None


def _json_problem(f: Path) -> str | None:
    """What polars reads wrongly, or refuses in words of its own, in a JSON input: no rows
    ("Cannot infer NDJSON types on empty reader"), a line that is not an object (an array gave
    "failed to determine supertype of struct[2] and list[i64]"), and a key one object gives
    twice (one value was taken in silence; a reply doing so is refused too). The file is read
    once per version (`job check` reads its columns, then its rows). None when it looks right, or
    is not UTF-8 JSON at all: polars refuses that, and `_unreadable` names the line."""
    try:
        stat = f.stat()
    except OSError:
        return None
    return _json_problem_of(str(f), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=32)
def _json_problem_of(name: str, mtime_ns: int, size: int) -> str | None:
    f = Path(name)
    try:
        if _json_array(f):  # one document: polars reads it whole too
            try:
                items = json.loads(f.read_bytes(), object_pairs_hook=_no_repeats)
            except _Repeated as r:
                return (f"an object of its array gives the key {r.key!r} twice (which value is meant is "
                        f"unclear); keep one")
            except ValueError:
                return None
            if not items:
                return "has no rows"
            if isinstance(items, list):
                for n, o in enumerate(items, 1):
                    if not isinstance(o, dict):
                        return f"item {n} of its array is not a JSON object (it holds {_json_kind(o)})"
            return None
        rows = 0
        with open(f, "rb") as lines:  # line by line: a file of millions of rows is never held whole
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                rows += 1
                try:
                    o = json.loads(line, object_pairs_hook=_no_repeats)
                except _Repeated as r:
                    return f"line {n} gives the key {r.key!r} twice (which value is meant is unclear); keep one"
                except ValueError:  # not JSON: polars refuses the file, and `_bad_line` names this line
                    continue
                if not isinstance(o, dict):
                    return (f"line {n} is not a JSON object (it holds {_json_kind(o)}); each line of a JSON "
                            f"Lines file is one object, such as {{\"id\": 1, \"text\": \"...\"}}")
    except (OSError, RecursionError):
        return None
    return None if rows else "has no rows"


class _Repeated(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            raise _Repeated(k)
        seen.add(k)
    return dict(pairs)


def _json_kind(v: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "true or false", int: "a number", float: "a number"}
    return "null" if v is None else kinds.get(type(v), type(v).__name__)


def _csv_problem(f: Path, header_only: bool = False) -> str | None:
    """What polars would read wrongly, or not at all, in a CSV file, with its line: a column name
    the header repeats (polars renames the second `<name>_duplicated_0`, which no template
    expects), and a line with more fields than the header or fewer (a separator lost or a line
    cut off: polars fills the missing fields with nulls, and the row went out with them). A
    blank line is left to polars (a row of nulls, whose id is refused as null). A field that is
    empty (`3,`) is a field; a quoted one may hold separators and line breaks. None when the
    file cannot be read as UTF-8 text (polars' error says so) or looks right."""
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # a document's text may pass the default 131,072 characters
    try:
        with open(f, newline="", encoding="utf-8-sig") as fh:
            rows = csv.reader(fh)
            header = next(rows, [])
            seen: dict[str, int] = {}
            for i, name in enumerate(header, 1):
                if name in seen:
                    return (f"line {rows.line_num}: the header repeats the column name {name!r} (fields "
                            f"{seen[name]} and {i}); give each column its own name")
                seen[name] = i
            if header_only:
                return None
            end = rows.line_num
            for row in rows:
                start, end = end + 1, rows.line_num
                if row and len(row) != len(header):
                    why = ("a separator or quote out of place?" if len(row) > len(header)
                           else "a separator lost, a quote out of place, or the line cut off?")
                    return (f"line {start} has {len(row)} field{'s' if len(row) != 1 else ''}, the header "
                            f"{len(header)}: {why}")
    except (OSError, UnicodeDecodeError, csv.Error):
        return None
    finally:
        csv.field_size_limit(limit)
    return None
