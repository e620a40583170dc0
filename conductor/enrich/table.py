"""A job's rows: the input read and joined, ids checked, prompts rendered, and a
content hash per row over the columns the template reads plus the job's
definition, so that a rerun can tell which rows changed."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import polars as pl
import pyarrow as pa

from conductor.enrich import inputs
from conductor.enrich.job import Job, template_env
from conductor.enrich.score import reference_value
from conductor.errors import InputError
from conductor.plans import MAX_INSTRUCTION_CHARS

_SHOW = 5


def load_rows(job: Job) -> pl.DataFrame:
    """The input after joins, in input order; every problem named with the ids involved."""
    df = _storable(_csv_ids(job, inputs.read(job.input_path)))
    where = f"job {job.path}: input {job.input_path}"
    if df.height == 0:
        raise InputError(f"{where}: has no rows")
    ids = df.get_column(job.id_column)
    _refuse_odd_ids(where, job.id_column, ids)
    dup = df.group_by(job.id_column).len().filter(pl.col("len") > 1).get_column(job.id_column).to_list()
    if dup:
        raise InputError(f"{where}: id column {job.id_column!r} has {len(dup)} duplicate id(s): {_list(sorted(dup))}")
    if df.get_column(job.id_column).dtype.is_float():
        raise InputError(f"{where}: id column {job.id_column!r} holds floats; use strings or integers")
    for j in job.joins:
        right = _storable(inputs.read(j.path))
        df, right = _text_key_as_integers(df, right, j.on)
        if (lt := df.get_column(j.on).dtype) != (rt := right.get_column(j.on).dtype):
            raise InputError(f"job {job.path}: join {j.path}: key {j.on!r} is {lt} in the input and {rt} there; "
                             f"give both the same type (e.g. text on both sides)")
        rdup = right.group_by(j.on).len().filter(pl.col("len") > 1).get_column(j.on).to_list()
        if rdup:
            raise InputError(f"job {job.path}: join {j.path}: key {j.on!r} repeats: {_list(rdup)}")
        right = right.select([j.on] + inputs.kept_columns(right, df.columns))
        missing = df.join(right.select(j.on), on=j.on, how="anti")
        if missing.height:
            empty = missing.filter(pl.col(j.on).is_null())  # no key to look up: not a key the table lacks
            unmatched = missing.filter(pl.col(j.on).is_not_null())
            why = []
            if empty.height:
                why.append(f"{empty.height} row(s) have an empty {j.on!r} (ids "
                           f"{_list(empty.get_column(job.id_column).to_list())}): fill their key in, or filter "
                           f"them out of the input")
            if unmatched.height:
                why.append(f"{unmatched.height} row(s) have no match on {j.on!r} (keys "
                           f"{_list(unmatched.get_column(j.on).to_list())}; ids "
                           f"{_list(unmatched.get_column(job.id_column).to_list())})")
            raise InputError(f"job {job.path}: join {j.path}: " + "; ".join(why))
        df = df.join(right, on=j.on, how="left", maintain_order="left")
    return df


def _refuse_odd_ids(where: str, column: str, ids: pl.Series) -> None:
    """An id is one string or integer per row, never null (audit66 F9). A list or struct id ran,
    and the view's id column was `int64[]`, which joins to nothing; an empty or blank text id was
    taken as an id, one no one can name in SQL or tell from a missing value."""
    if ids.dtype.is_nested():
        kind = "structs" if ids.dtype == pl.Struct else "lists"
        raise InputError(f"{where}: id column {column!r} holds {kind} ({ids.dtype}); an id is one string or "
                         f"integer per row: give the job another id column")
    if ids.dtype == pl.Boolean:  # a column of flags: a third row would be a duplicate id (audit75 F2)
        raise InputError(f"{where}: id column {column!r} holds booleans (true/false); an id is one string or "
                         f"integer per row: give the job another id column")
    missing = []
    if ids.null_count():
        missing.append(f"{ids.null_count()} null value(s) ({_rows(ids.is_null())})")
    if ids.dtype == pl.String and (blank := (ids.str.strip_chars() == "").fill_null(False)).any():
        missing.append(f"{blank.sum()} empty or blank value(s) ({_rows(blank)})")
    if missing:
        raise InputError(f"{where}: id column {column!r} has {' and '.join(missing)}; give those rows an id, or "
                         f"filter them out of the input")


def _rows(mask: pl.Series) -> str:
    """The rows a mask marks, counting the input's rows from 1 (a CSV's header is not a row)."""
    return "row(s) " + _list((mask.arg_true() + 1).to_list())


def _csv_ids(job: Job, df: pl.DataFrame) -> pl.DataFrame:
    """A CSV id column is read as text, then made integers only when every id is written as
    one (no 007: that id would become 7 and join back to nothing)."""
    ids = df.get_column(job.id_column)
    as_int = _integers(ids, pl.Int64) if ids.dtype == pl.String else None
    return df if as_int is None else df.with_columns(as_int)


def _integers(s: pl.Series, dtype: pl.DataType) -> pl.Series | None:
    """Text as integers of `dtype` when every value is written as one (no 007, no 7.0), else None."""
    as_int = s.cast(dtype, strict=False)
    if as_int.null_count() == s.null_count() and (as_int.cast(pl.String) == s).fill_null(True).all():
        return as_int
    return None


def _text_key_as_integers(df: pl.DataFrame, right: pl.DataFrame, on: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """A CSV is read as text: its join key written as integers (1, 2) still matches the integer
    key of a Parquet or JSON table. Keys such as 007 stay text, and the types are named."""
    lt, rt = df.get_column(on).dtype, right.get_column(on).dtype
    if lt == pl.String and rt.is_integer() and (k := _integers(df.get_column(on), rt)) is not None:
        return df.with_columns(k), right
    if rt == pl.String and lt.is_integer() and (k := _integers(right.get_column(on), lt)) is not None:
        return df, right.with_columns(k)
    return df, right


def _storable(df: pl.DataFrame) -> pl.DataFrame:
    """128-bit integers (JSON ids past 2**63) as text: Arrow and Parquet have no such type."""
    wide = [c for c, t in df.schema.items() if t in (pl.Int128, pl.UInt128)]
    return df.with_columns(pl.col(wide).cast(pl.String)) if wide else df


def ids_of(job: Job, df: pl.DataFrame) -> list[str]:
    """The rows' ids as strings (query ids); records keep the id column's own type."""
    return [str(v) for v in df.get_column(job.id_column).to_list()]


def render(job: Job, df: pl.DataFrame) -> list[str]:
    """The prompt of every row, without surrounding blank space (what is sent, verbatim);
    a row the template cannot render, or renders as nothing or too long to send, is an error
    naming its id, so `job check` finds it and `job run` stops before creating a run."""
    tmpl = template_env().from_string(job.prompt)
    names = list(job.template_names)
    cols = [inputs.as_written(df, n) for n in names]
    ids = df.get_column(job.id_column).to_list()
    out = []
    for i, rid in enumerate(ids):
        try:
            out.append(tmpl.render({n: c[i] for n, c in zip(names, cols)}).strip())
        except Exception as e:  # jinja2 raises UndefinedError, TypeError, ... from user templates
            raise InputError(f"job {job.path}: prompt: cannot render the row with {job.id_column} {rid!r}: "
                             f"{type(e).__name__}: {e}") from None
    _refuse_unsendable(job, ids, out)
    return out


def _refuse_unsendable(job: Job, ids: list[Any], prompts: list[str]) -> None:
    """Prompts no run can send: blank ones (the query set refuses them, stopping the whole run),
    and ones over the plan instruction limit (each would fail as invalid_plan in every run: the
    rendered prompt is a step's instruction in direct mode and in the embedded planner's plans)."""
    where = f"job {job.path}: input {job.input_path}"
    blank = [rid for rid, p in zip(ids, prompts) if not p]
    if blank:
        col = job.template_names[0] if job.template_names else "text"
        raise InputError(f"{where}: {len(blank)} row(s) render an empty prompt ({job.id_column} {_list(blank)}); "
                         f"filter them out of the input, or give the template a fallback for empty values, e.g. "
                         f"{{{{ ({col} or '') | trim or '(empty)' }}}}")
    long = [(rid, len(p)) for rid, p in zip(ids, prompts) if len(p) > MAX_INSTRUCTION_CHARS]
    if long:
        shown = ", ".join(f"{rid!r} ({n:,} characters)" for rid, n in long[:_SHOW])
        more = f" and {len(long) - _SHOW} more" if len(long) > _SHOW else ""
        raise InputError(f"{where}: {len(long)} row(s) render a prompt longer than {MAX_INSTRUCTION_CHARS:,} "
                         f"characters, conductor's limit for the instruction of one step "
                         f"({job.id_column} {shown}{more}); shorten their text or filter them out of the input")


def row_hashes(job: Job, df: pl.DataFrame, definition: str) -> list[str]:
    """Hash of (job definition, values of the columns the template reads), per row."""
    names = list(job.template_names)
    cols = [inputs.as_written(df, n) for n in names]
    prefix = definition.encode() + b"\0"
    out = []
    for i in range(df.height):
        values = orjson.dumps([c[i] for c in cols], default=str, option=orjson.OPT_NON_STR_KEYS)
        out.append(hashlib.sha256(prefix + values).hexdigest()[:32])
    return out


def references(job: Job, df: pl.DataFrame) -> list[str | None]:
    """Per row, the JSON object {field: reference value or null} the simulated pool answers from."""
    if not job.references:
        return [None] * df.height
    by_name = {f.name: f for f in job.fields}
    cols = {name: df.get_column(r.column).to_list() for name, r in job.references.items()}
    out = []
    for i in range(df.height):
        ref = {name: reference_value(by_name[name], cols[name][i]) for name in cols}
        out.append(orjson.dumps(ref, default=str).decode())
    return out


def render_queries(job: Job, df: pl.DataFrame | None = None) -> pa.Table:
    """The query set a job sends: query_id, prompt (exactly what direct mode sends as the user
    message), task "record" and the reference object. `conductor job queries` writes it."""
    df = load_rows(job) if df is None else df
    n = df.height
    return pa.table({
        "query_id": pa.array(ids_of(job, df), pa.string()),
        "prompt": pa.array(render(job, df), pa.string()),
        "task": pa.array(["record" if job.fields else None] * n, pa.string()),
        "reference": pa.array(references(job, df), pa.string()),
        "metadata": pa.nulls(n, pa.string()),
    })


def _list(values: list[Any]) -> str:
    shown = ", ".join(repr(v) for v in values[:_SHOW])
    return shown + (f" and {len(values) - _SHOW} more" if len(values) > _SHOW else "")
