"""How often the graders agree with a table's own correctness labels (the shared
replay tables, or any table with a label column), what kinds of disagreement there
are, and every row where they do not agree, for a reader to judge."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from conductor.errors import ConductorError
from conductor.grading import TASKS, grade_all
from conductor.replay.datasets import DATASETS


@dataclass(frozen=True)
class Disagreement:
    dataset: str
    question_id: str
    model: str
    reference: str
    answer: str | None
    label: bool
    verdict: bool | None
    response: str
    task: str | None = None
    detail: str | None = None

    @property
    def kind(self) -> str:
        """What sort of disagreement, for a reader deciding whom to believe."""
        if self.detail and self.detail.startswith("grader error"):
            return "grader error"
        if self.verdict is None:
            return "not graded (no reference or task)"
        if self.verdict:
            return "grader correct, label wrong"
        if self.answer is None:
            return "no answer extracted, label correct"
        return "extracted a different answer, label correct"


@dataclass(frozen=True)
class Agreement:
    dataset: str
    rows: int
    agreeing: int
    seconds: float
    disagreements: list[Disagreement]
    tasks: dict[str, int] = field(default_factory=dict)
    unlabelled: int = 0  # rows with no label: left out of `rows` and the rate
    unreferenced: int = 0  # labelled rows with no reference (null or blank): nothing to grade by, left out too

    @property
    def rate(self) -> float:
        return self.agreeing / self.rows if self.rows else 0.0

    def kinds(self) -> Counter:
        return Counter(d.kind for d in self.disagreements)


def check(replay_dir: Path, dataset: str, limit: int | None = None) -> Agreement:
    """Grade every response of one shared replay table and compare with its `correct` label."""
    return check_table(replay_dir / f"{dataset}.parquet", task=DATASETS[dataset], limit=limit, name=dataset)


def check_table(path: Path, *, task: str | None = None, limit: int | None = None, name: str | None = None,
                response_col: str = "response", reference_col: str = "reference", label_col: str = "correct") -> Agreement:
    """Grade every response of any table with a correctness label and compare: the task of a
    row is its `task` column's, else `task`."""
    path = Path(path)
    if not path.is_file():
        raise ConductorError(f"table {path} not found")
    try:
        table = (pl.read_csv(path, n_rows=limit, infer_schema_length=0, encoding="utf8-lossy")
                 if path.suffix.lower() == ".csv"  # base.CSV, as Windows names it, too
                 else _read_parquet_lossy(path, limit))
    except Exception as e:  # polars raises several types for a bad file
        raise ConductorError(f"table {path}: not a readable Parquet or CSV file ({e})") from None
    wanted = {"response": response_col, "reference": reference_col, "correct": label_col}
    flag = {"response": "--response-col", "reference": "--reference-col", "correct": "--label-col"}
    missing = [f"{c!r} ({flag[k]})" if c != k else repr(c) for k, c in wanted.items() if c not in table.columns]
    if missing:
        raise ConductorError(f"table {path}: missing column(s) {', '.join(missing)}; "
                             f"it has {', '.join(table.columns[:12])}")
    if task is not None and task not in TASKS:
        raise ConductorError(f"--task {task!r}: unknown (choose from {', '.join(TASKS)})")
    if "task" in table.columns:
        tasks = table.get_column("task").cast(pl.Utf8)
        # A blank task is no task (as replay/tables.py reads it): --task fills it, never "unknown ''".
        tasks = tasks.to_frame("t").select(pl.when(pl.col("t").str.strip_chars() != "").then(pl.col("t"))).to_series()
        unknown = sorted({t for t in tasks.drop_nulls().unique().to_list() if t not in TASKS})
        if unknown:
            raise ConductorError(f"table {path}: unknown task(s) {', '.join(map(repr, unknown))} in column 'task' "
                                 f"(allowed: {', '.join(TASKS)})")
        tasks = tasks.fill_null(task) if task else tasks
    else:
        if task is None:
            raise ConductorError(f"table {path}: no 'task' column; pass --task ({', '.join(TASKS)})")
        tasks = pl.Series([task] * table.height)
    labels = _labels(table.get_column(label_col), path, label_col)
    ids = (table.get_column("question_id").cast(pl.Utf8) if "question_id" in table.columns
           else pl.Series([str(i) for i in range(table.height)]))
    models = table.get_column("model").cast(pl.Utf8) if "model" in table.columns else pl.Series([""] * table.height)
    responses = table.get_column(response_col).cast(pl.Utf8).to_list()
    references = table.get_column(reference_col).cast(pl.Utf8).to_list()
    unlabelled = sum(label is None for label in labels)
    if unlabelled == table.height:
        raise ConductorError(f"table {path}: no row has a label in column {label_col!r} "
                             f"({table.height} row(s)); nothing to compare the grader with")
    # A null or blank reference is no reference, as eval reads it: nothing to grade by, so left
    # out and counted, never a disagreement.
    unreferenced = sum(label is not None and not (ref or "").strip() for ref, label in zip(references, labels))
    if unreferenced == table.height - unlabelled:
        raise ConductorError(f"table {path}: no labelled row has a reference in column {reference_col!r} "
                             f"({unreferenced} labelled row(s) with it empty); the grader has nothing to grade by")
    start = time.perf_counter()
    agreeing, bad, counted = 0, [], Counter()
    rows = [row for row in zip(ids.to_list(), models.to_list(), tasks.to_list(), responses, references, labels)
            if row[5] is not None and (row[4] or "").strip()]
    grades = grade_all((t, resp, ref) for _, _, t, resp, ref, _ in rows)  # code answers side by side
    for (qid, model, t, resp, ref, label), g in zip(rows, grades):
        counted[str(t)] += 1
        if g.correct is not None and bool(g.correct) == label:
            agreeing += 1
            continue
        bad.append(Disagreement(name or path.stem, str(qid), str(model or ""), str(ref), g.answer, label,
                                g.correct, resp or "", t, g.detail))
    return Agreement(name or path.stem, len(rows), agreeing, time.perf_counter() - start, bad,
                     dict(counted), unlabelled, unreferenced)


def _read_parquet_lossy(path: Path, limit: int | None) -> pl.DataFrame:
    """A Parquet table with its text read as a CSV's is: bytes that are not valid UTF-8 become
    U+FFFD, in text columns (which polars refuses to read then) and in Binary ones alike."""
    try:
        table = pl.read_parquet(path, n_rows=limit)
    except Exception:  # not UTF-8 somewhere, or not Parquet at all (pyarrow then says why)
        import pyarrow.parquet as pq

        arrow = pq.read_table(path)  # pyarrow does not check the UTF-8 of what it reads
        if limit is not None:
            arrow = arrow.slice(0, limit)
        table = pl.DataFrame([_lossy(name, arrow.column(name)) for name in arrow.column_names])
    binary = [c for c, t in table.schema.items() if t == pl.Binary]
    return table.with_columns(pl.Series(c, [None if v is None else v.decode("utf-8", "replace")
                                            for v in table.get_column(c).to_list()], dtype=pl.String)
                              for c in binary)


def _lossy(name: str, col) -> pl.Series:
    import pyarrow as pa

    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return pl.Series(name, [None if v is None else v.decode("utf-8", "replace")
                                for v in col.cast(pa.large_binary()).to_pylist()], dtype=pl.String)
    return pl.from_arrow(col).alias(name)


def _labels(col: pl.Series, path: Path, name: str) -> list[bool | None]:
    """A boolean label column, or 0/1 numbers, or true/false strings; anything else is
    named. A missing label is None: no evidence either way, so not a disagreement."""
    if col.dtype == pl.Boolean:
        return col.to_list()
    values = col.cast(pl.Utf8).str.to_lowercase().str.strip_chars().to_list()
    truth = {"1": True, "1.0": True, "true": True, "t": True, "yes": True,
             "0": False, "0.0": False, "false": False, "f": False, "no": False, None: None, "": None}
    odd = sorted({v for v in values if v not in truth})
    if odd:
        raise ConductorError(f"table {path}: column {name!r} must hold correctness labels (true/false or 1/0); "
                             f"found {', '.join(map(repr, odd[:5]))}")
    return [truth[v] for v in values]
