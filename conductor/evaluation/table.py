"""The recorded outcome of every (question, worker) pair a replay pool can serve:
correct by our grader, correct by the recorded label, tokens and cost.

Every table-based policy (single workers, best single, oracle, random) is a
choice of rows of this matrix, so each is a vectorized polars expression.
Each row is graded with its own task (a table may mix tasks); a row whose
question has no reference cannot be graded (`grader` is null) and counts by its
label only. A row with no label (`correct` null) is no evidence either way: its
question is left out of every figure by the labels (`label` is null on all its
rows), never counted as wrong. A question no worker of the pool recorded has no
row here but stays judged (`graded_ids`, `labelled_ids`): every policy counts it
as wrong, as a run of the pipeline does. Tokens are what the replay server reports: recorded counts when the
table has them, else characters / 4 (rounded up, conductor.tokens) of the question and
of the response, the completion at most the worker's max_tokens as the executor
counts it. Cost is the row's recorded `cost_usd` when it has one, else those tokens
times the pool's prices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import polars as pl
import pyarrow as pa

from conductor.errors import ConductorError
from conductor.grading import grade_all
from conductor.pool import Pool
from conductor.replay.tables import (COST_COLUMN, MIXED, charged_tokens_in, read_table, replay_source,
                                     replay_workers, shared_texts, with_tokens)


@dataclass(frozen=True)
class Matrix:
    # question_id, worker, split, task, graded, grader, label, unlabelled, tokens, cost, cost_recorded,
    # prompt_cut, prompt_recorded, prompt_charged
    rows: pl.DataFrame
    task: str | None  # the one task of the rows, or "mixed"
    dataset: str
    workers: list[str]  # the pool's replay workers, in pool order
    grading_s: float
    # Questions with a reference, which our grader can judge, whether or not a worker of the pool
    # recorded them: the denominator of every figure by our grader (an unrecorded one counts as wrong).
    graded_ids: frozenset[str]
    # Questions none of whose pool rows lacks a `correct` label (a question no worker of the pool
    # recorded included): the denominator of every figure by the labels (a missing label is no
    # evidence; `label` is null on every row of the other questions).
    labelled_ids: frozenset[str] = frozenset()
    # Ids recorded under one question text (replay.tables.shared_texts) with one of them evaluated:
    # the pipeline gets the first id's answers for all, the table policies each id's own rows.
    shared: list[list[str]] = field(default_factory=list)


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
            raise ConductorError(f"pool {pool.path}: worker {wid} has no price; `conductor replay pool` writes "
                                 f"one from the price table or the recorded cost_usd")
        prices[wid] = price
    t = source.tasks(read_table(source.table, ["question_id", "question", "reference", "model", "response",
                                               "correct"]))
    _check_queries(queries, t, source.table)
    shared = [g for g in shared_texts(t) if not question_ids.isdisjoint(g)]
    by_model = pl.DataFrame({"worker": list(workers), "model": list(workers.values()),
                             "p_in": [prices[w].input for w in workers], "p_out": [prices[w].output for w in workers],
                             "cap": [pool.worker(w).max_tokens() for w in workers]})
    t = t.filter(pl.col("question_id").is_in(list(question_ids)))
    # Which questions can be judged is a property of the question (its reference), not of the pool:
    # taken before the pool's workers are joined, so a question no worker of the pool recorded
    # stays in every denominator (wrong for every policy, as the pipeline counts it), not left out.
    asked = frozenset(t.get_column("question_id").to_list())
    graded = frozenset(t.filter(pl.col("reference").is_not_null()).get_column("question_id").to_list())
    t = (t.unique(subset=["question_id", "model"], keep="first", maintain_order=True)
         .join(by_model, on="model", how="inner"))
    # Tokens as the executor counts them on the same replayed answer (completions at most max_tokens,
    # prompts at most their bytes), so a single worker here costs what it costs when a plan runs it.
    t = with_tokens(t).with_columns(pl.col("tokens_in").alias("prompt_recorded"))
    t = t.with_columns(pl.min_horizontal("tokens_out", "cap").alias("tokens_out"),
                       charged_tokens_in().alias("tokens_in"))
    # A question with an unlabelled row is left out of the labels' figures altogether, so that
    # every policy's accuracy by the labels is over the same questions.
    t = t.with_columns(pl.col("correct").is_not_null().all().over("question_id").alias("labelled"))
    priced = pl.col("tokens_in") * pl.col("p_in") + pl.col("tokens_out") * pl.col("p_out")
    recorded = pl.col(COST_COLUMN) if COST_COLUMN in t.columns else pl.lit(None, dtype=pl.Float64)
    t = t.with_columns(recorded.alias("recorded_cost"))
    t0 = time.perf_counter()
    verdicts = [g.correct for g in grade_all(zip(
        t.get_column("task").to_list(), t.get_column("response").to_list(), t.get_column("reference").to_list()))]
    grading_s = time.perf_counter() - t0
    rows = t.select(
        "question_id", "worker", "split", "task",
        pl.col("reference").is_not_null().alias("graded"),
        pl.Series("grader", verdicts, dtype=pl.Boolean),
        pl.when(pl.col("labelled")).then(pl.col("correct")).alias("label"),
        pl.col("correct").is_null().alias("unlabelled"),
        (pl.col("tokens_in") + pl.col("tokens_out")).alias("tokens"),
        pl.coalesce(pl.col("recorded_cost"), priced).alias("cost"),
        pl.col("recorded_cost").is_not_null().alias("cost_recorded"),
        # Recorded prompt tokens above what a replayed call sends (the question alone): charged at that
        # bound, here and in the pipeline; the report says how many rows and by how much.
        (pl.col("prompt_recorded") > pl.col("tokens_in")).alias("prompt_cut"),
        "prompt_recorded", pl.col("tokens_in").alias("prompt_charged"),
    )
    tasks = sorted(set(t.get_column("task").to_list()))
    # Left out of the labels' figures: only a question with an unlabelled row of the pool's workers;
    # one no worker recorded has no such row, and counts (as wrong).
    labelled = asked - frozenset(t.filter(~pl.col("labelled")).get_column("question_id").to_list())
    return Matrix(rows, tasks[0] if len(tasks) == 1 else (MIXED if tasks else source.task), source.dataset,
                  list(workers), grading_s, graded, labelled, shared)


def _check_queries(queries: pa.Table, table: pl.DataFrame, path) -> None:
    """The queries must be questions of the table, with the prompt exactly the question and
    the question's task (a stale query set would be graded one way here and another in runs)."""
    known = {q: (text, task) for q, text, task in
             table.select("question_id", "question", "task").unique(subset=["question_id"]).iter_rows()}
    ids = queries.column("query_id").to_pylist()
    prompts = queries.column("prompt").to_pylist()
    tasks = queries.column("task").to_pylist()
    unknown = [q for q in ids if q not in known]
    if unknown:
        raise ConductorError(f"query set: {len(unknown)} query id(s) are not questions of {path} "
                             f"(e.g. {', '.join(unknown[:3])}); write the queries with `conductor replay queries`")
    changed = [q for q, p in zip(ids, prompts) if known[q][0] != p]
    if changed:
        raise ConductorError(f"query set: {len(changed)} prompt(s) differ from the recorded question "
                             f"(e.g. {', '.join(changed[:3])}); a replay pool answers only the original question")
    other = [q for q, task in zip(ids, tasks) if known[q][1] != task]
    if other:
        raise ConductorError(f"query set: {len(other)} query task(s) differ from the table's task for the question "
                             f"(e.g. {', '.join(f'{q}: {t!r} not {known[q][1]!r}' for q, t in zip(ids, tasks) if q in other[:3])}); "
                             f"write the queries with `conductor replay queries` from the pool's table")
