"""Replay tables (real recorded model outputs), read-only: the shared ones or any
table a user brings, at any path and under any file name.

A replay table holds one row per (question, model): the question exactly as the
model saw it, the model's full response, the gold answer (may be empty) and a
correctness label. Optional columns: `task` (which grader applies, row by row),
`prompt_tokens` / `completion_tokens` (recorded usage) and `cost_usd` (the
recorded dollars of the row, used instead of any estimate). Nothing in it is
copied into the repository: pool files and query sets that point at it are
written under data/ at run time.

Splits are a pure function of the question id (see `split_of`), so every command
and the learned policy agree on which questions are for training and which for
reporting, whatever file they start from.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import os
import re
import unicodedata
from dataclasses import dataclass, replace
from pathlib import Path

import polars as pl

from conductor.errors import ConductorError, PoolError
from conductor.grading import TASKS  # the tasks a replay table may name: the graders'
from conductor.pool import Pool, Worker
from conductor.tokens import MESSAGE_FRAMING_BOUND, tokens_from_chars
from conductor.replay.datasets import DATASETS, REPLAY_ENV, SPLITS, TRAIN_FRACTION, default_replay_dir  # noqa: F401

MIXED = "mixed"  # the pool's replay.task when the table's rows have more than one task
REQUIRED_COLUMNS = ("question_id", "question", "reference", "model", "response", "correct")
TASK_COLUMN = "task"
# Recorded usage, when a table has it; else the server and the evaluation estimate it (conductor.tokens).
TOKEN_COLUMNS = ("prompt_tokens", "completion_tokens")
COST_COLUMN = "cost_usd"  # recorded USD of the row: used instead of tokens x price wherever present
OPTIONAL_COLUMNS = (TASK_COLUMN, *TOKEN_COLUMNS, COST_COLUMN)

# Split: sha256("<salt>:<question_id>"), first 8 bytes as a fraction of 2**64; below
# TRAIN_FRACTION is train. 50/50 keeps a test set large enough to compare policies.
SPLIT_SALT = "conductor-replay-split-v1"

REPLAY_KEYS = {"dataset", "table", "task", "default_task", "prices", "split", "skills", "costs", "fingerprint"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_SHOW = 5  # question ids shown in an error message


def split_of(question_id: str) -> str:
    """'train' or 'test', fixed forever by the question id."""
    h = int.from_bytes(hashlib.sha256(f"{SPLIT_SALT}:{question_id}".encode()).digest()[:8], "big")
    return "train" if h < TRAIN_FRACTION * 2**64 else "test"


def table_path(replay_dir: Path, dataset: str) -> Path:
    """The shared table `--dataset` names."""
    if dataset not in DATASETS:
        raise ConductorError(f"--dataset {dataset!r}: unknown (choose from {', '.join(DATASETS)}, "
                             f"or give any table with --table PATH)")
    if not Path(replay_dir).is_dir():
        raise ConductorError(f"replay folder {replay_dir} not found: pass --replay-dir DIR or set ${REPLAY_ENV}")
    path = Path(replay_dir) / f"{dataset}.parquet"
    if not path.is_file():
        raise ConductorError(f"replay table {path} not found")
    return path


# ---------------------------------------------------------------- which table, named how


@dataclass(frozen=True)
class TableSpec:
    """A replay table as the user named it on the command line."""

    path: Path
    name: str  # names pool descriptions, run ids and reports: --name, else the file stem
    task: str | None  # for rows without a task of their own: --task, else a shared stem's default
    prices: Path | None  # list prices per model (prices.csv's columns), if any
    # The shared dataset (gsm8k, mmlu_pro) when the table IS its shared file (--dataset, or --table at
    # that file): only then do the pool's descriptions carry the shared data's provenance. A user's
    # own table named gsm8k.parquet, or given --name gsm8k, is not the shared GSM8K.
    shared: str | None = None


def table_spec(*, table: Path | str | None = None, dataset: str | None = None, name: str | None = None,
               task: str | None = None, prices: Path | str | None = None,
               replay_dir: Path | str | None = None) -> TableSpec:
    """--table PATH or --dataset gsm8k|mmlu_pro (the shared file), with --name, --task and --prices.

    Prices default to prices.csv in the replay folder, when there is one."""
    if (table is None) == (dataset is None):
        raise ConductorError("give the recorded table with --table PATH, or --dataset "
                             f"{'|'.join(DATASETS)} for a shared one (not both)")
    folder = Path(replay_dir) if replay_dir else default_replay_dir()
    if dataset is not None:
        path = table_path(folder, dataset)
        shared = dataset
    else:
        path = Path(table).expanduser()
        if not path.is_file():
            raise ConductorError(f"--table {path}: not found" if not path.exists() else
                                 f"--table {path}: is a folder; give the Parquet file")
        shared = shared_dataset(path, folder)
    if task is not None and task not in TASKS:
        raise ConductorError(f"--task {task!r}: unknown (choose from {', '.join(TASKS)})")
    if prices is not None:
        prices = Path(prices).expanduser()
        if not prices.is_file():
            raise ConductorError(f"--prices {prices}: not found")
    elif (folder / "prices.csv").is_file():
        prices = folder / "prices.csv"
    return TableSpec(path.resolve(), dataset_name(path, name), task or DATASETS.get(path.stem),
                     prices.resolve() if prices else None, shared)


def shared_dataset(path: Path, replay_dir: Path | None = None) -> str | None:
    """The shared dataset whose file `path` is (the same file, not the same name), else None."""
    folder = Path(replay_dir) if replay_dir else default_replay_dir()
    for dataset in DATASETS:
        shared = folder / f"{dataset}.parquet"
        try:
            if shared.is_file() and os.path.samefile(path, shared):
                return dataset
        except OSError:
            continue
    return None


def dataset_name(path: Path, name: str | None = None) -> str:
    """--name as given (checked), else the table's file stem made safe for run ids and folders."""
    if name is not None:
        if not _NAME_RE.match(name) or len(name) > 64:
            raise ConductorError(f"--name {name!r}: use up to 64 letters, digits, '-', '_' and '.', "
                                 f"starting with a letter or digit")
        return name
    # Accents dropped, not the letters: `ünï` was `-n-`
    stem = Path(path).stem
    decomposed = unicodedata.normalize("NFKD", stem)
    ascii_stem = decomposed.encode("ascii", "ignore").decode()
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", ascii_stem).strip("-_.")
    # Letters with no ASCII form (日本, 中文) are dropped too: a short hash of the stem keeps such
    # tables apart, else all were `table` and shared run ids and report folders.
    if any(not c.isascii() and not unicodedata.combining(c) for c in decomposed):
        digest = hashlib.sha256(stem.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        return f"{(base or 'table')[:55]}-{digest}"
    return base[:64] or "table"


# ---------------------------------------------------------------- reading and checking a table


def table_columns(path: Path) -> dict[str, pl.DataType]:
    """The table's column names and types; a clear error for a file that is not Parquet."""
    try:
        return dict(pl.read_parquet_schema(path))
    except Exception as e:  # polars raises several types for a bad file
        reader = {".csv": "read_csv", ".tsv": "read_csv", ".jsonl": "read_ndjson", ".ndjson": "read_ndjson",
                  ".json": "read_json"}.get(Path(path).suffix.lower())
        # A CSV's text columns are read as text: inferred, id 007 became 7 and reference 0.5 a float.
        names = ["question_id", "reference", *_STRINGS, "category"]
        text = "" if reader != "read_csv" else f", schema_overrides=dict.fromkeys({names}, pl.String)"
        hint = ("" if reader is None else
                f"; replay tables are read as Parquet only: convert it first, e.g. python -c \"import polars as pl; "
                f"pl.{reader}('{path}'{', infer_schema_length=None' if reader != 'read_json' else ''}{text}"
                f"{', separator=chr(9)' if Path(path).suffix.lower() == '.tsv' else ''})"
                f".write_parquet('{Path(path).with_suffix('.parquet')}')\"")
        raise ConductorError(f"replay table {path}: not a readable Parquet file ({e}){hint}") from None


def read_table(path: Path, columns: list[str] | None = None) -> pl.DataFrame:
    """The replay table (or some of its columns), checked and with normalized types.

    Always brings question_id and whichever optional columns the table has (task,
    tokens, cost_usd), and adds `split`. Keeps the table's row order, which fixes
    which row answers a question asked twice under two ids (the first; see
    `shared_texts`). Every required column is checked, whichever are asked for. A
    missing or mistyped column is an error naming the file and the column; bad values
    name the question ids."""
    path = Path(path)
    schema = table_columns(path)
    missing = [c for c in REQUIRED_COLUMNS if c not in schema]
    if missing:
        raise ConductorError(f"replay table {path}: missing column(s) {', '.join(missing)} "
                             f"(required: {', '.join(REQUIRED_COLUMNS)})")
    optional = [c for c in OPTIONAL_COLUMNS if c in schema]
    wanted = list(schema) if columns is None else list(dict.fromkeys([*columns, "question_id", *optional]))
    absent = [c for c in wanted if c not in schema]
    if absent:
        raise ConductorError(f"replay table {path}: missing column(s) {', '.join(absent)}")
    for c in dict.fromkeys([*REQUIRED_COLUMNS, *wanted]):
        _check_type(path, c, schema[c])
    # Every command checks the same values, whatever columns it uses: a table that one step takes
    # must not fail a later one (the responses too: text that is not UTF-8 is refused by all).
    checked = list(dict.fromkeys([*wanted, *REQUIRED_COLUMNS]))
    table = read_columns(path, checked)
    if table.is_empty():
        raise ConductorError(f"replay table {path}: has no rows (a replay table holds one row per question "
                             f"and model: {', '.join(REQUIRED_COLUMNS)})")
    table = _normalize(path, table).select(wanted)
    ids = table.get_column("question_id").unique()
    splits = pl.DataFrame({"question_id": ids, "split": [split_of(q) for q in ids.to_list()]},
                          schema={"question_id": pl.String, "split": pl.String})
    return table.join(splits, on="question_id", how="left", maintain_order="left")


def read_columns(path: Path, columns: list[str]) -> pl.DataFrame:
    """pl.read_parquet of some columns, with text that is not valid UTF-8 (which polars refuses
    with a bare "invalid utf-8") an error naming the file, the column and the rows."""
    try:
        return pl.read_parquet(path, columns=columns)
    except Exception as e:  # polars raises several types for a bad file
        bad = _invalid_utf8(path, columns)
        if bad:
            shown = "; ".join(f"column '{c}' at {where}" for c, where in bad.items())
            raise ConductorError(
                f"replay table {path}: text that is not valid UTF-8 in {shown}; replay tables hold UTF-8 text: "
                f"write the table again with its text decoded (e.g. bytes.decode(encoding) with the encoding "
                f"it was written in, or 'utf-8', errors='replace')") from None
        raise ConductorError(f"replay table {path}: not a readable Parquet file ({e})") from None


def _invalid_utf8(path: Path, columns: list[str]) -> dict[str, str]:
    """column -> where its text is not valid UTF-8 (row numbers, question ids when readable)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from conductor.queries import invalid_utf8_rows

    try:
        t = pq.read_table(path, columns=columns)  # pyarrow does not check the UTF-8 of what it reads
    except Exception:
        return {}
    ids: list | None = None
    if "question_id" in t.column_names:
        try:
            ids = t.column("question_id").to_pylist()
        except Exception:  # the ids themselves are not text
            ids = None
    out: dict[str, str] = {}
    for name in t.column_names:
        col = t.column(name)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            continue
        rows = invalid_utf8_rows(col)
        if rows:
            good_ids = ids is not None and name != "question_id"
            out[name] = (f"{len(rows)} row(s), question id(s) {_show([str(ids[i]) for i in rows])}" if good_ids
                         else f"{len(rows)} row(s), row(s) {_show([str(i) for i in rows])} (counting from 0)")
    return out


_STRINGS = ("question", "model", "response", TASK_COLUMN)
_NUMBERS = (*TOKEN_COLUMNS, COST_COLUMN)


MAX_RECORDED_TOKENS = 10 ** 9  # no call reads or writes a billion tokens
MAX_RECORDED_USD = 10_000  # nor costs ten thousand dollars
MAX_PRICE_PER_MTOK = 1_000_000  # nor is a token priced above a dollar: 10,000 tokens would cost the above


def _check_type(path: Path, col: str, dtype: pl.DataType) -> None:
    def bad(want: str) -> ConductorError:
        return ConductorError(f"replay table {path}: column '{col}' must hold {want}, not {dtype}")

    text = dtype in (pl.String, pl.Categorical, pl.Null) or isinstance(dtype, (pl.Categorical, pl.Enum))
    if col in _STRINGS and not text:
        raise bad("strings")
    if col in ("question_id", "reference") and not (text or dtype.is_integer()):
        raise bad("strings (or integers)")
    if col == "correct" and not (dtype in (pl.Boolean, pl.Null) or dtype.is_numeric()):
        hint = ("" if not text else "; make text labels booleans first, e.g. with polars "
                "pl.col('correct').str.strip_chars().str.to_lowercase().is_in(['true', 'yes', '1'])")
        raise ConductorError(f"replay table {path}: column 'correct' must hold booleans or 0/1 numbers, "
                             f"not {dtype}{hint}")
    if col in _NUMBERS and not (dtype == pl.Null or dtype.is_numeric()):
        raise bad("numbers")


def _normalize(path: Path, t: pl.DataFrame) -> pl.DataFrame:
    """Cast to the types the rest of replay works with and refuse values nothing can use."""
    casts = [pl.col(c).cast(pl.String) for c in ("question_id", "reference", *_STRINGS) if c in t.columns]
    t = t.with_columns(casts)
    if "reference" in t.columns:  # an empty reference is no reference: nothing to grade by
        t = t.with_columns(pl.when(pl.col("reference").str.strip_chars() != "").then(pl.col("reference"))
                           .alias("reference"))
    for c in ("question_id", "question", "model"):  # "" or blanks are as empty as null: nothing to ask or serve
        blank = pl.col(c).is_null() | (pl.col(c).str.strip_chars() == "")
        if c in t.columns and t.select(blank.any()).item():
            where = (f"at row(s) {_show([str(i) for i in t.with_row_index().filter(blank)['index']])}"
                     if c == "question_id" else f"for question id(s) {_ids(t, blank)}")
            raise ConductorError(f"replay table {path}: column '{c}' is empty {where}")
    # One answer per model and question, one text per question: else rows would be dropped (the
    # server and the evaluation keep one) while the pool's skills counted them all.
    if {"question_id", "model"} <= set(t.columns):
        twice = t.filter(pl.struct("question_id", "model").is_duplicated())
        if twice.height:
            raise ConductorError(f"replay table {path}: {twice.height} rows repeat a (question_id, model) pair, "
                                 f"e.g. question id(s) {_show(twice.get_column('question_id').unique(maintain_order=True).to_list())}"
                                 f"; keep one answer per model and question")
    if {"question_id", "question"} <= set(t.columns):
        texts = t.group_by("question_id", maintain_order=True).agg(pl.col("question").n_unique().alias("n"))
        split = texts.filter(pl.col("n") > 1).get_column("question_id").to_list()
        if split:
            raise ConductorError(f"replay table {path}: question id(s) {_show(split)} name more than one question "
                                 f"text; give each text its own id")
    if "correct" in t.columns and t.schema["correct"] != pl.Boolean:
        c = pl.col("correct").cast(pl.Float64)
        off = c.is_not_null() & ~c.is_in([0.0, 1.0])
        if t.select(off.any()).item():
            raise ConductorError(f"replay table {path}: column 'correct' must hold booleans or 0/1 numbers; "
                                 f"other values for question id(s) {_ids(t, off)}")
        t = t.with_columns((c == 1.0).alias("correct"))
    for c in _NUMBERS:
        if c not in t.columns:
            continue
        v = pl.col(c).cast(pl.Float64)
        # Bounded too: 2**64 (an "unknown" sentinel) was a traceback, and sums of 1e18 wrapped around
        most = MAX_RECORDED_TOKENS if c in TOKEN_COLUMNS else MAX_RECORDED_USD
        off = v.is_not_null() & (v.is_nan() | v.is_infinite() | (v < 0) | (v > most))
        if c in TOKEN_COLUMNS:
            off = off | (v.is_not_null() & (v != v.round(0)))
        if t.select(off.any()).item():
            what = (f"whole numbers of tokens from 0 to {most:,}" if c in TOKEN_COLUMNS else
                    f"USD amounts of one call: finite numbers from 0 to {most:,}")
            raise ConductorError(f"replay table {path}: column '{c}' must hold {what}; other values for "
                                 f"question id(s) {_ids(t, off)}")
        t = t.with_columns(v.cast(pl.Int64) if c in TOKEN_COLUMNS else v)
    return t


def with_tasks(t: pl.DataFrame, fallback: str | None, path: Path) -> pl.DataFrame:
    """Set `task` on every row: the row's own `task` value, else `fallback` (--task, or the
    shared stem's default). Unknown tasks, rows without one and questions whose rows
    disagree are errors naming the question ids."""
    if TASK_COLUMN in t.columns:
        own = pl.when(pl.col(TASK_COLUMN).str.strip_chars() != "").then(pl.col(TASK_COLUMN))
        t = t.with_columns(own.fill_null(pl.lit(fallback, dtype=pl.String)).alias("task"))
    else:
        t = t.with_columns(pl.lit(fallback, dtype=pl.String).alias("task"))
    unknown = pl.col("task").is_not_null() & ~pl.col("task").is_in(TASKS)
    if t.select(unknown.any()).item():
        values = t.filter(unknown).get_column("task").unique(maintain_order=True).to_list()
        raise ConductorError(f"replay table {path}: column 'task' has unknown value(s) {_show(values, quote=True)} "
                             f"for question id(s) {_ids(t, unknown)} (allowed: {', '.join(TASKS)})")
    if t.get_column("task").null_count():
        raise ConductorError(f"replay table {path}: no task for question id(s) {_ids(t, pl.col('task').is_null())}: "
                             f"fill its '{TASK_COLUMN}' column or pass --task ({', '.join(TASKS)})")
    multi = t.group_by("question_id", maintain_order=True).agg(pl.col("task").n_unique().alias("n"))
    multi = multi.filter(pl.col("n") > 1).get_column("question_id").to_list()
    if multi:
        raise ConductorError(f"replay table {path}: question id(s) {_show(multi)} have rows of more than one task; "
                             f"a question is graded one way")
    return t


def shared_texts(t: pl.DataFrame) -> list[list[str]]:
    """Ids (in table order) whose questions are one text to the replay server: equal but for
    leading and trailing whitespace, which plan parsing trims. The server sees only the text,
    so it answers all of them with the first id's recorded responses."""
    groups: dict[str, list[str]] = {}
    for qid, q in t.select("question_id", "question").unique("question_id", maintain_order=True).iter_rows():
        groups.setdefault(q.strip(), []).append(qid)
    return [ids for ids in groups.values() if len(ids) > 1]


def check_shared_texts(t: pl.DataFrame, path: Path) -> list[list[str]]:
    """`shared_texts` of `t` (with reference and task), refused when the ids of one text differ in
    reference or task: the server's answer (the first id's) would be graded against another
    id's reference, or another way. Returns the groups that agree, where only which recorded
    answer is served differs (the shared MMLU-Pro table has 7 such pairs)."""
    groups = shared_texts(t)
    if not groups:
        return []
    ids = {q for g in groups for q in g}
    keyed = {qid: (question, ref, task) for qid, question, ref, task in
             t.filter(pl.col("question_id").is_in(list(ids))).unique("question_id", maintain_order=True)
             .select("question_id", "question", "reference", "task").iter_rows()}
    bad = [g for g in groups if len({keyed[q][1:] for q in g}) > 1]
    if bad:
        shown = "; ".join(f"{', '.join(g)} ({' '.join(keyed[g[0]][0].split())[:60]!r})" for g in bad[:_SHOW])
        more = f" and {len(bad) - _SHOW} more" if len(bad) > _SHOW else ""
        raise ConductorError(
            f"replay table {path}: question ids {shown}{more} share one question text (but for leading and "
            f"trailing whitespace) with different references or tasks; the replay server tells questions apart "
            f"only by their text, so it would answer each of them with the first id's recorded responses. Keep "
            f"one id per text, e.g. python -c \"import polars as pl; t = pl.read_parquet('{path}'); "
            f"t.filter(pl.col('question_id') == pl.col('question_id').first().over(pl.col('question').str.strip_chars()))"
            f".write_parquet('{path.stem}-one-id-per-text.parquet')\"")
    return groups


def recorded_tokens(t: pl.DataFrame) -> tuple[pl.Expr, pl.Expr]:
    """The recorded prompt and completion tokens a row's usage can be believed for, null where
    none: 0 tokens for the question (never empty), or for a response that has text, is taken as
    not recorded, as the executor takes such usage from any server (engine._clamped: "0 tokens
    reported for a prompt or answer with text"). Logs often write 0 where usage was not captured;
    believed, every table policy was free while a plan paid for the same answers."""
    p_in, p_out = TOKEN_COLUMNS
    rec_in = (pl.when(pl.col(p_in) != 0).then(pl.col(p_in)) if p_in in t.columns
              else pl.lit(None, dtype=pl.Int64))
    has_text = pl.col("response").fill_null("") != ""
    rec_out = (pl.when((pl.col(p_out) != 0) | ~has_text).then(pl.col(p_out)) if p_out in t.columns
               else pl.lit(None, dtype=pl.Int64))
    return rec_in, rec_out


def with_tokens(t: pl.DataFrame) -> pl.DataFrame:
    """Add tokens_in, tokens_out (recorded, else characters / 4 of the question and of the
    response) and tokens_estimated (either was estimated), as the replay server reports them.
    A recorded 0 beside text counts as not recorded (`recorded_tokens`)."""
    est_in = tokens_from_chars(pl.col("question").str.len_chars())
    est_out = tokens_from_chars(pl.col("response").fill_null("").str.len_chars())
    rec_in, rec_out = recorded_tokens(t)
    t_in, t_out = rec_in.fill_null(est_in), rec_out.fill_null(est_out)
    flags = [rec_in.is_null(), rec_out.is_null()]
    return t.with_columns(t_in.alias("tokens_in"), t_out.alias("tokens_out"),
                          (flags[0] | flags[1]).alias("tokens_estimated"))


def charged_tokens_in() -> pl.Expr:
    """tokens_in as the executor charges a replayed call: at most the question's UTF-8 bytes and
    a message's framing (tokens.max_prompt_tokens, its bound on any prompt's tokens; a replay
    step sends the question alone). A log's counts often include a system prompt or few-shot
    examples the question lacks: taken as recorded, a table policy cost more than the same
    call in a plan."""
    return pl.min_horizontal("tokens_in", pl.col("question").str.len_bytes() + MESSAGE_FRAMING_BOUND)


def _ids(t: pl.DataFrame, mask: pl.Expr) -> str:
    ids = t.filter(mask).get_column("question_id").unique(maintain_order=True).to_list()
    return _show([str(i) for i in ids])


def _show(values: list, quote: bool = False) -> str:
    shown = [repr(v) if quote else str(v) for v in values[:_SHOW]]
    more = f" and {len(values) - _SHOW} more" if len(values) > _SHOW else ""
    return ", ".join(shown) + more


# ---------------------------------------------------------------- prices


def read_prices(path: Path) -> dict[str, tuple[float, float, str]]:
    """model -> (input USD per Mtok, output USD per Mtok, basis), from prices.csv."""
    path = Path(path)
    if not path.is_file():
        raise ConductorError(f"price table {path} not found")
    out: dict[str, tuple[float, float, str]] = {}
    seen: dict[str, int] = {}
    raw = path.read_bytes()
    try:
        # utf-8-sig: spreadsheets save "CSV UTF-8" with a byte order mark before the first column's name.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # Excel's plain "CSV" is Windows-1252 (an en dash is byte 0x96)
        line = raw[:e.start].count(b"\n") + 1
        raise ConductorError(f"price table {path}, line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); "
                             f"save it as UTF-8 (a spreadsheet's \"CSV UTF-8\")") from None
    with io.StringIO(text, newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        need = {"model", "input_usd_per_mtok", "output_usd_per_mtok"}
        if not need <= set(header):
            raise ConductorError(f"price table {path}: needs columns {', '.join(sorted(need))} "
                                 f"(its header: {', '.join(header) or 'none'})")
        col = {h: i for i, h in reversed(list(enumerate(header)))}
        for cells in reader:
            line = reader.line_num
            row = {h: (cells[i].strip() if i < len(cells) else "") for h, i in col.items()}
            if not any(row.values()):
                continue  # a blank line, or one of empty cells as spreadsheets leave
            model = row["model"]
            if not model:
                raise ConductorError(f"price table {path}, line {line}: no model name")
            if model in seen:  # which of the two is meant cannot be guessed
                raise ConductorError(f"price table {path}, lines {seen[model]} and {line}: model {model!r} is "
                                     f"listed twice; keep one price per model")
            seen[model] = line
            try:
                p_in, p_out = float(row["input_usd_per_mtok"]), float(row["output_usd_per_mtok"])
            except ValueError:
                raise ConductorError(f"price table {path}, line {line}: prices must be numbers (model {model!r}: "
                                     f"{row['input_usd_per_mtok']!r}, {row['output_usd_per_mtok']!r})") from None
            if not (math.isfinite(p_in) and math.isfinite(p_out) and p_in >= 0 and p_out >= 0):
                raise ConductorError(f"price table {path}, line {line}: prices must be finite and at least 0 "
                                     f"(model {model!r}: {p_in:g}, {p_out:g})")
            if max(p_in, p_out) > MAX_PRICE_PER_MTOK:  # as cost_usd is bounded: 1e300 was a crash downstream
                raise ConductorError(f"price table {path}, line {line}: prices must be at most "
                                     f"{MAX_PRICE_PER_MTOK:,} USD per million tokens, a dollar a token "
                                     f"(model {model!r}: {p_in:g}, {p_out:g})")
            out[model] = (p_in, p_out, row.get("basis", ""))
    return out


# ---------------------------------------------------------------- the pool's replay block


@dataclass(frozen=True)
class ReplaySource:
    """What a pool's `replay:` block says: which table its workers answer from."""

    dataset: str
    table: Path
    task: str | None  # the table's one task, or "mixed" (row by row, from its task column)
    default_task: str | None = None  # mixed tables: the task of rows whose task column is empty

    @property
    def fallback(self) -> str | None:
        """The task of a row that names none."""
        return self.default_task or (self.task if self.task != MIXED else None)

    def tasks(self, t: pl.DataFrame) -> pl.DataFrame:
        """`t` (rows of this table) with each row's task set (see `with_tasks`)."""
        return with_tasks(t, self.fallback, self.table)


def replay_source(pool: Pool) -> ReplaySource:
    """Validate `pool.replay`; relative table paths are relative to the pool file."""
    raw = pool.replay
    where = f"pool file {pool.path}: replay" if pool.path else "replay"
    if raw is None:
        raise PoolError(f"{where.rsplit(':', 1)[0]}: not a replay pool (no replay: block); "
                        f"write one with `conductor replay pool`")
    unknown = sorted(set(map(str, raw)) - REPLAY_KEYS)
    if unknown:
        raise PoolError(f"{where}.{unknown[0]}: unknown field (allowed: {', '.join(sorted(REPLAY_KEYS))})")
    dataset = raw.get("dataset")
    if not isinstance(dataset, str) or not dataset:
        raise PoolError(f"{where}.dataset: required (a name such as gsm8k)")
    table = raw.get("table")
    if not isinstance(table, str) or not table:
        raise PoolError(f"{where}.table: required (path of the replay Parquet table)")
    path = Path(os.path.expandvars(table)).expanduser()
    if not path.is_absolute() and pool.path:
        path = Path(pool.path).resolve().parent / path
    if not path.is_file():
        raise PoolError(f"{where}.table: {path} not found")
    split = raw.get("split")
    if split is not None and split != {"salt": SPLIT_SALT, "train_fraction": TRAIN_FRACTION}:
        # The skills were measured on a train split: it must be the one this code reports against.
        raise PoolError(f"{where}.split: {split!r} is not this version's split (salt {SPLIT_SALT}, "
                        f"train_fraction {TRAIN_FRACTION}); rewrite the pool with `conductor replay pool`")
    task = raw.get("task", DATASETS.get(dataset))
    if task is not None and task not in (*TASKS, MIXED):
        raise PoolError(f"{where}.task: must be one of {', '.join(TASKS)} or {MIXED} (got {task!r})")
    default = raw.get("default_task")
    if default is not None and default not in TASKS:
        raise PoolError(f"{where}.default_task: must be one of {', '.join(TASKS)} (got {default!r})")
    _check_unchanged(pool, raw, path, where)
    return ReplaySource(dataset, path, task, default)


def _check_unchanged(pool: Pool, raw: dict, path: Path, where: str) -> None:
    """The table as the pool was written from it (`fingerprint`). A pool written before pools
    recorded one is taken as it is: it was accepted so far, and refusing it would stop every
    existing pool at once for a change that most tables never see (`replay serve` says so)."""
    from conductor.replay import fingerprint as fp

    recorded = raw.get(fp.FIELD)
    if recorded is None:
        return
    if why := fp.check_shape(recorded):
        raise PoolError(f"{where}.{fp.FIELD}: {why} (as `conductor replay pool` writes it); rewrite the pool")
    try:
        diff = fp.changed(recorded, path)
    except OSError as e:
        raise PoolError(f"{where}.table: {path} cannot be read ({e.strerror or e})") from None
    if diff:
        pool_file = pool.path or "(in memory)"
        raise PoolError(f"replay table {path} changed since the pool {pool_file} was written from it ({diff}): "
                        f"the pool's skills, prices and max_call_usd are the old table's, while the replay server "
                        f"and the evaluation read the new one (a budget could be overrun). Rewrite the pool: "
                        f"{rewrite_command(pool, raw, path)}")


def rewrite_command(pool: Pool, raw: dict, path: Path) -> str:
    """`conductor replay pool` writing this pool again from `path`, with the --name, --task,
    --prices and --api-base its replay block and workers show."""
    import shlex

    from conductor.replay.datasets import DEFAULT_URL

    args = ["conductor", "replay", "pool", "--table", str(path), "--out", str(pool.path or "POOL.yaml")]
    if raw.get("dataset") != dataset_name(path):
        args += ["--name", str(raw.get("dataset"))]
    task = raw.get("default_task") or raw.get("task")
    if task not in (None, MIXED, DATASETS.get(path.stem)):
        args += ["--task", str(task)]
    if raw.get("prices"):
        args += ["--prices", str(raw["prices"])]
    base = _written_api_base(pool)
    if base is not None and base != DEFAULT_URL:
        args += ["--api-base", base]
    return shlex.join(args) + " (and --models as before, if the pool holds only some of the table's models)"


def _written_api_base(pool: Pool) -> str | None:
    """The replay workers' api_base as the pool file has it (`${CONDUCTOR_REPLAY_URL:-...}`
    unexpanded), else as loaded."""
    import yaml

    ids = set(replay_workers(pool))
    try:
        doc = yaml.safe_load(Path(pool.path).read_text(encoding="utf-8")) if pool.path else None
        written = [w.get("api_base") for w in doc["workers"] if isinstance(w, dict) and w.get("id") in ids]
    except Exception:  # noqa: BLE001 - only the command's wording depends on it
        written = [pool.worker(w).api_base for w in ids]
    return written[0] if written and isinstance(written[0], str) else None


def recorded_model(worker: Worker) -> str | None:
    """The table's model name a worker replays: its model after 'openai/'."""
    if worker.kind != "llm" or not worker.model or not worker.model.startswith("openai/"):
        return None
    return worker.model.split("/", 1)[1] or None


def replay_workers(pool: Pool) -> dict[str, str]:
    """worker id -> recorded model name, for the pool's replayable llm workers."""
    return {w.id: m for w in pool.workers if (m := recorded_model(w)) is not None}


def with_recorded(pool: Pool) -> Pool:
    """The pool with `recorded` (see Pool) filled when it is a replay pool."""
    if pool.replay is None or pool.recorded is not None:
        return pool
    return replace(pool, recorded=servable(pool))


def servable(pool: Pool) -> dict[str, frozenset[str]]:
    """question text -> ids of the pool's workers that have a recorded response to it.

    The planner uses this to plan only steps the replay server can answer."""
    source = replay_source(pool)
    by_model: dict[str, list[str]] = {}
    for wid, model in replay_workers(pool).items():
        by_model.setdefault(model, []).append(wid)
    if not by_model:
        return {}
    t = read_columns(source.table, ["question", "model"]).select(pl.all().cast(pl.String)).filter(
        pl.col("model").is_in(list(by_model)) & pl.col("question").is_not_null()).unique()
    out: dict[str, set[str]] = {}
    for q, m in t.iter_rows():
        out.setdefault(q, set()).update(by_model[m])
    return {q: frozenset(ws) for q, ws in out.items()}
