"""A job's input table: Parquet, CSV or JSON Lines (by extension; a .json file may
also hold one JSON array of objects), one file or a folder of them, left-joined
with lookup tables. Read with polars."""

from __future__ import annotations

from pathlib import Path

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


def scan(path: Path, text: tuple[str, ...] = ()) -> pl.LazyFrame:
    """`text`: CSV columns read as text whatever they look like (an id such as 007)."""
    files = input_files(path)
    kind = FORMATS[files[0].suffix.lower()]
    try:
        if kind == "parquet":
            return pl.scan_parquet(files)
        if kind == "csv":
            return pl.concat([pl.scan_csv(f, infer_schema_length=10_000, schema_overrides={c: pl.String for c in text})
                              for f in files], how="diagonal_relaxed")
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


def read(path: Path, text: tuple[str, ...] = ()) -> pl.DataFrame:
    try:
        return scan(path, text).collect()
    except InputError:
        raise
    except Exception as e:
        raise _unreadable(path, input_files(path), e) from None


def _json_array(f: Path) -> bool:
    """A .json file holding one array of objects, not JSON Lines."""
    if f.suffix.lower() != ".json":
        return False
    with open(f, "rb") as fh:
        return fh.read(4096).lstrip().startswith(b"[")


def _unreadable(path: Path, files: list[Path], e: Exception, what: str = "cannot read") -> InputError:
    """The error for a file polars cannot read; for text that is not UTF-8, the file and line."""
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
    return InputError(f"input {path}: {what} ({type(e).__name__}: {e})")
