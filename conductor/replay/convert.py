"""Wide recorded tables (one row per prompt, columns per model) into replay tables.

RouterBench ships its recorded outputs this way: `sample_id`, `prompt`,
`eval_name`, `oracle_model_to_route_to`, and per model M a score column `M`
(0/1, or between 0 and 1 for judged tasks), `M|model_response` and
`M|total_cost` (USD). The column names are settings (`WideLayout`), so other
wide tables convert the same way. The long table has one row per (prompt,
model): question_id, question, reference, model, response, correct, score,
cost_usd, and category and task when there are any.

Such tables often have no gold answer: then `reference` is empty and `correct`
comes from the score, so the graders cannot re-grade those rows and the
evaluation reports their accuracy from the labels only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from conductor.errors import ConductorError
from conductor.replay.tables import MAX_RECORDED_USD, TASKS

READERS = (".parquet", ".csv", ".jsonl", ".ndjson")


@dataclass(frozen=True)
class WideLayout:
    """Column names of a wide table; the defaults are RouterBench's."""

    id_column: str = "sample_id"
    prompt_column: str = "prompt"
    reference_column: str | None = None  # RouterBench has no gold answers
    category_column: str | None = "eval_name"
    response_suffix: str = "|model_response"
    cost_suffix: str | None = "|total_cost"


def read_wide(path: Path) -> pl.DataFrame:
    path = Path(path)
    if not path.is_file():
        raise ConductorError(f"--wide {path}: not found")
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            return pl.read_parquet(path)
        if suffix == ".csv":  # all text: guessing types made id 007 the number 7 and response 007 "7.0"
            return pl.read_csv(path, infer_schema_length=0)
        if suffix in (".jsonl", ".ndjson"):
            return pl.read_ndjson(path, infer_schema_length=None)
    except Exception as e:  # polars raises several types for a bad file
        raise ConductorError(f"--wide {path}: not a readable {suffix[1:]} file ({e})") from None
    hint = (" RouterBench's .pkl files are pandas pickles: convert one first with "
            "`python -c \"import pandas as pd; pd.read_pickle('routerbench_0shot.pkl').to_parquet('routerbench_0shot.parquet')\"`"
            if suffix in (".pkl", ".pickle") else "")
    raise ConductorError(f"--wide {path}: reads {', '.join(READERS)} files only.{hint}")


def parse_task_map(items: list[str]) -> dict[str, str]:
    """['grade-school-math=math', ...] -> {'grade-school-math': 'math', ...}."""
    out = {}
    for item in items:
        prefix, sep, task = item.rpartition("=")
        if not sep or not prefix or task not in TASKS:
            raise ConductorError(f"--task-map {item!r}: expected PREFIX=TASK with TASK one of {', '.join(TASKS)}")
        out[prefix] = task
    return out


def dropped_models(columns: list[str], layout: WideLayout = WideLayout()) -> list[str]:
    """Columns M that look like a model's (a cost column M<cost-suffix> beside them) but have no
    response column M<response-suffix>: not converted, and more often renamed than meant."""
    cols = set(columns)
    if not layout.cost_suffix:
        return []
    return [c for c in columns if f"{c}{layout.cost_suffix}" in cols and f"{c}{layout.response_suffix}" not in cols]


def convert_wide(path: Path, layout: WideLayout = WideLayout(), *, models: list[str] | None = None,
                 threshold: float | None = None, task: str | None = None,
                 task_map: dict[str, str] | None = None, wide: pl.DataFrame | None = None) -> pl.DataFrame:
    """The long replay table of a wide table (see the module's docstring); `wide`: the table
    at `path`, when the caller has read it already."""
    path = Path(path)
    wide = read_wide(path) if wide is None else wide
    if wide.height == 0:  # else 0 questions were written, and the next command refused them
        raise ConductorError(f"--wide {path}: has no rows")
    cols = set(wide.columns)
    flags = {"--id-column": layout.id_column, "--prompt-column": layout.prompt_column,
             "--reference-column": layout.reference_column, "--category-column": layout.category_column}
    for flag, col in flags.items():
        if col is not None and col not in cols:
            raise ConductorError(f"--wide {path}: no column {col!r} ({flag}); columns: {_few(wide.columns)}")
    if task is not None and task not in TASKS:
        raise ConductorError(f"--task {task!r}: unknown (choose from {', '.join(TASKS)})")
    suffix = layout.response_suffix
    found = [c[:-len(suffix)] for c in wide.columns if c.endswith(suffix) and c[:-len(suffix)] in cols]
    if not found:
        raise ConductorError(f"--wide {path}: no model columns: each model M needs a score column M and a "
                             f"response column M{suffix}")
    if models:
        unknown = [m for m in models if m not in found]
        if unknown:
            raise ConductorError(f"--models: {', '.join(unknown)} not in {path} (models: {', '.join(found)})")
        found = list(dict.fromkeys(models))
    cost_cols = [c for c in (f"{m}{layout.cost_suffix}" for m in found) if layout.cost_suffix and c in cols]
    wide = _as_numbers(wide, found, path, "a score (0/1, or 0..1)", truth=True)
    wide = _as_numbers(wide, cost_cols, path, "USD")
    for m in found:
        _numeric(wide, m, path, "a score (0/1, or 0..1)")
        _within(wide, m, path, "a score from 0 to 1", 0.0, 1.0)
        if layout.cost_suffix and f"{m}{layout.cost_suffix}" in cols:
            _numeric(wide, f"{m}{layout.cost_suffix}", path, "USD")
            _within(wide, f"{m}{layout.cost_suffix}", path, f"USD of one call, from 0 to {MAX_RECORDED_USD:,}",
                    0.0, MAX_RECORDED_USD)  # as the long table takes it: inf was written, then refused
    ids = _text(wide, layout.id_column)
    for flag, col in (("--id-column", layout.id_column), ("--prompt-column", layout.prompt_column)):
        # Named here, by the wide table's rows: the long table's would point at rows the user never wrote.
        blank = wide.select((_text(wide, col).str.strip_chars() == "").fill_null(True).alias("b")).get_column("b")
        if blank.any():
            rows = [str(i + 1) for i in blank.arg_true().to_list()]
            raise ConductorError(f"--wide {path}: column {col!r} ({flag}) is empty at row(s) {_few(rows)} "
                                 f"(counting the first data row as 1)")
    dup = wide.select(ids.is_duplicated().alias("d")).get_column("d")
    if dup.any():
        shown = wide.filter(dup).select(ids).to_series().unique(maintain_order=True).to_list()
        raise ConductorError(f"--wide {path}: column {layout.id_column!r} repeats id(s) {_few(shown)}")
    partial = [m for m in found if wide.select(pl.col(m).cast(pl.Float64).is_between(0, 1, closed="none").any()).item()]
    if partial and threshold is None:
        raise ConductorError(f"--wide {path}: scores strictly between 0 and 1 in column(s) {_few(partial)}: "
                             f"pass --threshold T (correct = score >= T)")
    if threshold is not None and not math.isfinite(threshold):
        raise ConductorError(f"--threshold must be a finite number (got {threshold}): correct = score >= it")
    if threshold is not None and not 0 < threshold <= 1:  # else every answer is wrong, or every one right
        raise ConductorError(f"--threshold must be above 0 and at most 1, as scores lie from 0 to 1 (got {threshold}): "
                             f"correct = score >= it")
    cut = 1.0 if threshold is None else float(threshold)
    base = [pl.col("_row"), ids.alias("question_id"), _text(wide, layout.prompt_column).alias("question"),
            (_text(wide, layout.reference_column) if layout.reference_column
             else pl.lit(None, pl.String)).alias("reference"),
            *([_text(wide, layout.category_column).alias("category")] if layout.category_column else [])]
    indexed = wide.with_row_index("_row")
    parts = []
    for i, m in enumerate(found):
        cost_col = f"{m}{layout.cost_suffix}" if layout.cost_suffix else None
        part = indexed.select(
            *base, pl.lit(i, pl.Int64).alias("_model"), pl.lit(m, pl.String).alias("model"),
            _text(wide, f"{m}{suffix}").alias("response"), pl.col(m).cast(pl.Float64).alias("score"),
            (pl.col(cost_col).cast(pl.Float64) if cost_col and cost_col in cols
             else pl.lit(None, pl.Float64)).alias("cost_usd"))
        parts.append(part.filter(pl.col("score").is_not_null() | pl.col("response").is_not_null()))
    long = pl.concat(parts).sort("_row", "_model")
    long = long.with_columns(pl.when(pl.col("score").is_not_null()).then(pl.col("score") >= cut).alias("correct"))
    tasks = _tasks(long, task, task_map or {})
    if tasks is not None:
        long = long.with_columns(tasks.alias("task"))
    order = ["question_id", "question", "reference", "model", "response", "correct", "score", "cost_usd",
             *(["category"] if layout.category_column else []), *(["task"] if tasks is not None else [])]
    return long.select(order)


def _tasks(long: pl.DataFrame, task: str | None, task_map: dict[str, str]) -> pl.Expr | None:
    """Each row's task: the longest --task-map prefix its category starts with, else --task."""
    if not task_map:
        return pl.lit(task, pl.String) if task else None
    if "category" not in long.columns:
        raise ConductorError("--task-map matches the category column; give --category-column")
    expr = pl.lit(task, pl.String)
    for prefix, t in sorted(task_map.items(), key=lambda kv: len(kv[0])):  # longer prefixes override shorter
        expr = pl.when(pl.col("category").str.starts_with(prefix)).then(pl.lit(t)).otherwise(expr)
    return expr


def _text(wide: pl.DataFrame, col: str) -> pl.Expr:
    """A column as strings; a list of strings (RouterBench stores some prompts so) joined by a blank line."""
    dtype = wide.schema[col]
    if isinstance(dtype, pl.List):
        return pl.col(col).cast(pl.List(pl.String)).list.join("\n\n")
    return pl.col(col).cast(pl.String)


def _as_numbers(wide: pl.DataFrame, columns: list[str], path: Path, what: str, truth: bool = False) -> pl.DataFrame:
    """Text columns that must hold numbers (a CSV's are all text) as Float64: blanks around a
    value are dropped, a score may say true/false, and anything else is named, with its column."""
    for col in [c for c in columns if wide.schema[c] == pl.String]:
        text = pl.col(col).str.strip_chars()
        if truth:
            low = text.str.to_lowercase()
            text = pl.when(low == "true").then(pl.lit("1")).when(low == "false").then(pl.lit("0")).otherwise(text)
        value = text.cast(pl.Float64, strict=False)
        given = pl.col(col).str.strip_chars() != ""  # a blank cell is no value, as an empty one is
        bad = wide.filter(given & value.is_null()).get_column(col).unique(maintain_order=True)
        if bad.len():
            raise ConductorError(f"--wide {path}: column {col!r} must hold numbers ({what}); "
                                 f"found {_few([repr(v) for v in bad.to_list()])}")
        wide = wide.with_columns(value.alias(col))
    return wide


def _numeric(wide: pl.DataFrame, col: str, path: Path, what: str) -> None:
    dtype = wide.schema[col]
    if not (dtype.is_numeric() or dtype in (pl.Boolean, pl.Null)):
        raise ConductorError(f"--wide {path}: column {col!r} must hold numbers ({what}), not {dtype}")


def _within(wide: pl.DataFrame, col: str, path: Path, what: str, low: float, high: float) -> None:
    """NaN (which polars counts as above any cut, so as correct) and values out of range are named."""
    v = pl.col(col).cast(pl.Float64)
    bad = wide.filter(v.is_not_null() & (v.is_nan() | (v < low) | (v > high))).get_column(col).to_list()
    if bad:
        raise ConductorError(f"--wide {path}: column {col!r} must hold {what}; found {_few(sorted(set(map(str, bad))))}")


def _few(values: list) -> str:
    shown = ", ".join(map(str, values[:8]))
    return shown + (f" and {len(values) - 8} more" if len(values) > 8 else "")
