"""Query sets: Parquet files of prompts, validated before anything is written.

Every problem found is reported at once, naming the file, the column and the
offending ids, so that a user fixes a file in one pass.
"""

from __future__ import annotations

import hashlib
import string
from collections import Counter
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from conductor.errors import InputError
from conductor.grading import QUERY_TASKS, TASKS as GRADED  # the graders define the tasks
from conductor.plans import MAX_INSTRUCTION_CHARS
from conductor.schemas import RESULTS

TASKS = QUERY_TASKS  # the graders' tasks and "record" (an enrichment job's rows)
COLUMNS = ("query_id", "prompt", "task", "reference", "metadata")
SCHEMA = pa.schema([(c, pa.string()) for c in COLUMNS])
_SHOW = 5
# A prompt is sent as a step's instruction, which holds at most MAX_INSTRUCTION_CHARS; a graded
# task's prompt gets the answer-line convention appended (the embedded planner's is under 100).
ANSWER_LINE_ROOM = 200
MAX_PROMPT_CHARS = MAX_INSTRUCTION_CHARS - ANSWER_LINE_ROOM


def load_queries(path: str | Path) -> pa.Table:
    """Read and validate a query set; returns a table with exactly `SCHEMA`."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"query set {path}: file not found")
    if path.is_dir():
        raise InputError(f"query set {path}: is a folder; give one Parquet file")
    try:
        # the names first: pyarrow cannot read a file with a column name given twice, and says
        # so in its own words ("Multiple matches for FieldRef.Name(...)") and its schema dump
        if twice := _given_twice(pq.read_schema(path).names):
            raise InputError(f"query set {path}: {twice}")
        table = pq.read_table(path)
    except InputError:
        raise
    except Exception as e:  # pyarrow raises several types for a bad file
        raise InputError(f"query set {path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    return validate(table, str(path))


def _given_twice(names: list[str]) -> str | None:
    """The columns whose name is given more than once, which Parquet allows and no reader can
    tell apart by name; None when every name is given once."""
    counts = Counter(names)
    twice = [f"{n!r} ({k} times)" for n, k in counts.items() if k > 1]
    if not twice:
        return None
    return (f"column name(s) given more than once: {', '.join(twice)}; rename or drop the copies, "
            f"so that each name is one column")


def validate(table: pa.Table, where: str) -> pa.Table:
    if twice := _given_twice(table.column_names):
        raise InputError(f"query set {where}: {twice}")
    problems: list[str] = []
    names = set(table.column_names)
    for col in ("query_id", "prompt"):
        if col not in names:
            problems.append(f"column '{col}' is missing (columns present: {', '.join(table.column_names) or 'none'})")
    if problems:
        raise InputError(f"query set {where}: " + "; ".join(problems))

    cols = {}
    for col in COLUMNS:
        if col not in names:
            cols[col] = pa.nulls(table.num_rows, pa.string())
            continue
        arr = table.column(col)
        if col in ("query_id", "reference") and pa.types.is_integer(arr.type):  # math sets keep gold numbers
            arr = pc.cast(arr, pa.string())
        if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type) or pa.types.is_null(arr.type)):
            hint = (" (write it as text: a float loses how the answer was written, 2.50 or 2.5)"
                    if col == "reference" and pa.types.is_floating(arr.type) else "")
            problems.append(f"column '{col}' must hold strings, not {arr.type}{hint}")
            continue
        cols[col] = pc.cast(arr, pa.string()).combine_chunks()
    problems += _carry_clashes(table.column_names)
    if problems:
        raise InputError(f"query set {where}: " + "; ".join(problems))
    # Parquet can hold bytes that are not UTF-8: planning would crash on them, and a carried
    # column would be copied into results.parquet, which no query could then read
    extra = {n: table.column(n) for n in table.column_names if n not in COLUMNS}
    for col, arr in {**cols, **extra}.items():
        bad = invalid_utf8_rows(arr)
        if bad:
            shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            who = "" if col == "query_id" else _utf8_ids(cols["query_id"], bad)
            problems.append(f"column '{col}' holds text that is not valid UTF-8 at row(s) {shown}{who}")
    if problems:
        raise InputError(f"query set {where}: " + "; ".join(problems))

    ids = cols["query_id"]
    null_ids = pc.sum(pc.is_null(ids)).as_py() or 0
    if null_ids:
        rows = _rows(pc.is_null(ids))
        problems.append(f"column 'query_id' has {null_ids} null value(s) at row(s) {rows}")
    else:
        empty_ids = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(ids)), 0)
        if pc.any(empty_ids).as_py():
            problems.append(f"column 'query_id' has empty id(s) at row(s) {_rows(empty_ids)}")
        counts = pc.value_counts(ids)
        dup = [v["values"] for v in counts.to_pylist() if v["counts"] > 1]
        if dup:
            problems.append(f"column 'query_id' has {len(dup)} duplicate id(s): {_list(dup)}")

    prompt = cols["prompt"]
    bad_prompt = pc.or_kleene(pc.is_null(prompt), pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(prompt)), 0))
    bad_prompt = pc.fill_null(bad_prompt, True)
    if pc.any(bad_prompt).as_py():
        problems.append(f"column 'prompt' is null or empty for query_id(s) {_ids(ids, bad_prompt)}")

    task = cols["task"]
    if too_long := _too_long(ids, prompt, task):
        problems.append(too_long)
    bad_task = pc.and_(pc.is_valid(task), pc.invert(pc.is_in(task, pa.array(TASKS))))
    bad_task = pc.fill_null(bad_task, False)
    if pc.any(bad_task).as_py():
        values = sorted(set(pc.filter(task, bad_task).to_pylist()))
        problems.append(
            f"column 'task' has unknown value(s) {_list(values)} for query_id(s) {_ids(ids, bad_task)} "
            f"(allowed: {', '.join(TASKS)} or null)")

    meta = cols["metadata"]
    bad_meta = [i for i, m in enumerate(meta.to_pylist()) if m is not None and not _is_json(m)]
    if bad_meta:
        mask = pc.is_in(pa.array(range(len(meta))), pa.array(bad_meta))
        problems.append(f"column 'metadata' is not valid JSON for query_id(s) {_ids(ids, mask)}")

    if problems:
        raise InputError(f"query set {where}: " + "; ".join(problems))
    if table.num_rows == 0:
        raise InputError(f"query set {where}: has no rows")
    return pa.table(cols, schema=SCHEMA)


def _too_long(ids: pa.Array, prompt: pa.Array, task: pa.Array) -> str | None:
    """Prompts longer than a step's instruction can hold: each would become an invalid plan
    naming a step's instruction, in every run. A graded prompt's limit leaves room for the
    answer line; an ungraded one is sent as it is. Rows of task `record` are conductor's own
    (an enrichment job's rendered prompts, checked when the job loads; a judge's, which fail
    alone when too long), so they are left to the plan check."""
    length = pc.fill_null(pc.utf8_length(prompt), 0)
    graded = pc.fill_null(pc.is_in(task, pa.array(GRADED)), False)
    limit = pc.if_else(graded, MAX_PROMPT_CHARS, MAX_INSTRUCTION_CHARS)
    long = pc.and_(pc.greater(length, limit), pc.invert(pc.fill_null(pc.equal(task, "record"), False)))
    rows = [i for i, v in enumerate(long.to_pylist()) if v]
    if not rows:
        return None
    shown = ", ".join(f"{ids[i].as_py()!r} ({length[i].as_py():,} characters, limit {limit[i].as_py():,})"
                      for i in rows[:_SHOW])
    more = f" and {len(rows) - _SHOW} more" if len(rows) > _SHOW else ""
    return (f"column 'prompt' is longer than a step can send for query_id(s) {shown}{more}: a step's instruction "
            f"holds at most {MAX_INSTRUCTION_CHARS:,} characters, {ANSWER_LINE_ROOM} of them kept for the answer "
            f"line of a graded task; shorten those prompts or leave them out")


def carried_name(name: str) -> str:
    """The results.parquet column a query-set column `name` (not in COLUMNS) is carried as. DuckDB
    reads names without regard to case, so `Status` is renamed as `status` is: kept as it was,
    `SELECT Status FROM results` read conductor's status and the user's column became `Status_1`."""
    return f"input_{name}" if _folded(name) in _RESULTS_NAMES else name


def _folded(name: str) -> str:
    """A name as DuckDB compares names: A-Z as a-z, every other letter as it is (`É` is not `é`)."""
    return name.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)
_RESULTS_NAMES = {_folded(n) for n in RESULTS.names}


def _carry_clashes(names: list[str]) -> list[str]:
    """Columns that would be carried under one name as DuckDB reads names (case aside): the run
    would keep one of them only, or SQL would read one under a name DuckDB invents (`Note_1`).
    Refused here, before anything is written, rather than renamed behind the user's back."""
    groups: dict[str, list[str]] = {}
    for name in names:
        if name not in COLUMNS:
            groups.setdefault(_folded(carried_name(name)), []).append(name)
    problems = []
    for group in groups.values():
        if len(group) < 2:
            continue
        outs = {carried_name(n) for n in group}
        if len(outs) == 1:  # `input_status` and `status`
            renamed = next(n for n in group if carried_name(n) != n)
            problems.append(f"columns {_and(group)} would both be carried into results.parquet as '{outs.pop()}' "
                            f"(results has its own '{renamed}'); rename one of them")
        else:  # `note` and `Note`, or `Status` and `input_status`
            named = [f"'{n}'" + (f" (as '{carried_name(n)}')" if carried_name(n) != n else "") for n in group]
            problems.append(f"columns {_and(named, quote=False)} would be carried into results.parquet under names "
                            f"that differ only in case, which SQL (DuckDB) reads as one name; "
                            f"rename all but one of them")
    return problems


def _and(items: list[str], quote: bool = True) -> str:
    items = [f"'{i}'" if quote else i for i in items]
    return ", ".join(items[:-1]) + " and " + items[-1]


def input_columns(path: str | Path) -> pa.Table | None:
    """The query set's columns other than COLUMNS, in row order; None when it has none.
    `conductor run` carries them into results.parquet."""
    names = [n for n in pq.ParquetFile(path).schema_arrow.names if n not in COLUMNS]
    return pq.read_table(path, columns=names) if names else None


def invalid_utf8_rows(arr: pa.Array | pa.ChunkedArray) -> list[int]:
    """Rows of a column (text, or lists, structs and dictionaries holding text) whose text is not
    valid UTF-8: pyarrow reads it unchecked. Only a column that fails Arrow's full check is
    looked at row by row."""
    try:
        arr.validate(full=True)
        return []
    except pa.ArrowInvalid:
        pass
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        values = arr.cast(pa.binary()).to_pylist()
        return [i for i, v in enumerate(values) if v is not None and not _is_utf8(v)]
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    out = []
    for i in range(len(arr)):
        try:
            arr[i].as_py()
        except UnicodeDecodeError:
            out.append(i)
    return out


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _utf8_ids(ids: pa.Array, rows: list[int]) -> str:
    try:
        return " (query_id " + ", ".join(str(ids[i].as_py()) for i in rows[:10]) + ")"
    except Exception:  # the ids themselves may be bad
        return ""


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _is_json(s: str) -> bool:
    try:
        orjson.loads(s)
        return True
    except orjson.JSONDecodeError:
        return False


def _rows(mask: pa.Array) -> str:
    idx = [i for i, v in enumerate(mask.to_pylist()) if v]
    return _list(idx)


def _ids(ids: pa.Array, mask: pa.Array) -> str:
    return _list(pc.filter(ids, mask).to_pylist())


def _list(values: list) -> str:
    shown = ", ".join(repr(v) for v in values[:_SHOW])
    return shown + (f" and {len(values) - _SHOW} more" if len(values) > _SHOW else "")
