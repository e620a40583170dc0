"""The recorded outcome of every (question, worker) pair a replay pool can serve:
correct by our grader, correct by the benchmark's label, tokens and cost.

Every table-based policy (single workers, best single, oracle, random) is a
choice of rows of this matrix, so each is a vectorized polars expression.
Tokens are what the replay server reports: recorded counts when the table has
them, else characters / 4 (rounded half to even) of the question and of the response.
Cost is those tokens times the pool's prices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import polars as pl
import pyarrow as pa

from conductor.errors import ConductorError
from conductor.grading import grade
from conductor.pool import Pool
from conductor.replay.tables import TOKEN_COLUMNS, estimate_tokens, read_table, replay_source, replay_workers


@dataclass(frozen=True)
class Matrix:
    rows: pl.DataFrame  # question_id, worker, split, grader, label, tokens, cost
    task: str | None
    dataset: str
    workers: list[str]  # the pool's replay workers, in pool order
    grading_s: float


def build_matrix(pool: Pool, queries: pa.Table, question_ids: set[str]) -> Matrix:
    """Rows for `question_ids` (the evaluated queries plus any selection set), graded."""
    source = replay_source(pool)
    workers = replay_workers(pool)
    if not workers:
        raise ConductorError(f"pool {pool.path}: no llm worker with an 'openai/<name>' model to evaluate")
    prices = {}
    for wid in workers:
        price = pool.worker(wid).price
        if price is None:
            raise ConductorError(f"pool {pool.path}: worker {wid} has no price; `conductor replay pool` imports "
                                 f"them from prices.csv")
        prices[wid] = price
    t = read_table(source.table, ["question_id", "question", "reference", "model", "response", "correct"])
    _check_queries(queries, t, source.table)
    by_model = pl.DataFrame({"worker": list(workers), "model": list(workers.values()),
                             "p_in": [prices[w].input for w in workers], "p_out": [prices[w].output for w in workers]})
    t = t.filter(pl.col("question_id").is_in(list(question_ids))).join(by_model, on="model", how="inner")
    if all(c in t.columns for c in TOKEN_COLUMNS):
        t_in = pl.col("prompt_tokens").fill_null(estimate_tokens(pl.col("question").str.len_chars()))
        t_out = pl.col("completion_tokens").fill_null(estimate_tokens(pl.col("response").str.len_chars()))
    else:
        t_in = estimate_tokens(pl.col("question").str.len_chars())
        t_out = estimate_tokens(pl.col("response").str.len_chars())
    t = t.with_columns(t_in.alias("tokens_in"), t_out.alias("tokens_out"))
    t0 = time.perf_counter()
    task = source.task
    verdicts = [bool(grade(task, r, ref).correct) for r, ref in zip(t.get_column("response").to_list(),
                                                                     t.get_column("reference").to_list())]
    grading_s = time.perf_counter() - t0
    rows = t.select(
        "question_id", "worker", "split",
        pl.Series("grader", verdicts, dtype=pl.Boolean),
        pl.col("correct").fill_null(False).alias("label"),
        (pl.col("tokens_in") + pl.col("tokens_out")).alias("tokens"),
        (pl.col("tokens_in") * pl.col("p_in") + pl.col("tokens_out") * pl.col("p_out")).alias("cost"),
    )
    return Matrix(rows, task, source.dataset, list(workers), grading_s)


def _check_queries(queries: pa.Table, table: pl.DataFrame, path) -> None:
    """The queries must be questions of the table, with the prompt exactly the question."""
    known = dict(table.select("question_id", "question").unique(subset=["question_id"]).iter_rows())
    ids = queries.column("query_id").to_pylist()
    prompts = queries.column("prompt").to_pylist()
    unknown = [q for q in ids if q not in known]
    if unknown:
        raise ConductorError(f"query set: {len(unknown)} query id(s) are not questions of {path} "
                             f"(e.g. {', '.join(unknown[:3])}); write the queries with `conductor replay queries`")
    changed = [q for q, p in zip(ids, prompts) if known[q] != p]
    if changed:
        raise ConductorError(f"query set: {len(changed)} prompt(s) differ from the recorded question "
                             f"(e.g. {', '.join(changed[:3])}); a replay pool answers only the original question")
