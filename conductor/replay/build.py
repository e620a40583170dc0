"""Query sets and pool files made from a replay table, written under data/ at run time.

The query set: one query per question, prompt = the question exactly as the
models saw it (so the replay server can answer it), query_id = question_id,
task = the question's task (row by row for a mixed table).

The pool file: one llm worker per recorded model ("openai/<model>" at the replay
server's URL), its price (the price table's list price, or for a model with no
list price or with `cost_usd` on every row an effective price from the recorded
`cost_usd`, see `effective_prices`), its expected accuracy per
task (`skills`) measured on the train split only, and the local function workers
`vote` and `extract`.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pyarrow as pa
import yaml

from conductor.errors import ConductorError
from conductor.queries import SCHEMA
from conductor.replay.datasets import DEFAULT_URL
from conductor.replay.fingerprint import fingerprint
from conductor.replay.tables import (COST_COLUMN, MIXED, SPLIT_SALT, SPLITS, TASK_COLUMN, TRAIN_FRACTION, TableSpec,
                                     check_shared_texts, read_prices, read_table, table_columns, with_tasks,
                                     with_tokens)

SOURCES = {
    "gsm8k": "GSM8K test, zero-shot, JSON-formatted answers (ZeroEval)",
    "mmlu_pro": "MMLU-Pro test sample, 5-shot chain of thought (TIGER-AI-Lab)",
}


def query_table(spec: TableSpec, split: str = "all") -> pa.Table:
    """One query per question of the table (first-appearance order), optionally one split."""
    if split not in SPLITS:
        raise ConductorError(f"--split {split!r}: choose from {', '.join(SPLITS)}")
    cols = ["question_id", "question", "reference"]
    t = read_table(spec.path, cols + (["category"] if "category" in table_columns(spec.path) else []))
    t = with_tasks(t, spec.task, spec.path)
    check_shared_texts(t, spec.path)
    qs = t.unique(subset=["question_id"], keep="first", maintain_order=True)
    if split != "all":
        qs = qs.filter(pl.col("split") == split)
        if qs.is_empty():
            raise ConductorError(f"replay table {spec.path}: no question is in the {split} split (the split is "
                                 f"fixed by a hash of each question_id; --split all takes every question)")
    rows = qs.to_dicts()
    meta = [orjson.dumps({"dataset": spec.name, "category": _text(r.get("category")), "split": r["split"]}).decode()
            for r in rows]
    return pa.table({
        "query_id": [r["question_id"] for r in rows],
        "prompt": [r["question"] for r in rows],
        "task": [r["task"] for r in rows],
        "reference": [r["reference"] for r in rows],
        "metadata": meta,
    }, schema=SCHEMA)


def effective_prices(t: pl.DataFrame) -> dict[str, tuple[float, int]]:
    """model -> (USD per token, rows it is measured on), for models whose rows record cost_usd.

    One rate for input and output tokens alike: the sum of the recorded costs of the
    model's train-split rows that have one, divided by the sum of those rows' tokens
    (recorded, else characters / 4, as the replay server reports them). A model with
    no costed train row is measured on all its costed rows. Budgets reserve with it
    (at least the model's largest recorded cost, the worker's `max_call_usd`) and the
    prior planner estimates with it; each call is still charged its own recorded cost."""
    if COST_COLUMN not in t.columns:
        return {}
    costed = t.filter(pl.col(COST_COLUMN).is_not_null())
    out: dict[str, tuple[float, int]] = {}
    for rows in (costed, costed.filter(pl.col("split") == "train")):  # train, where it has rows, wins
        agg = rows.group_by("model").agg(pl.col(COST_COLUMN).sum().alias("usd"),
                                         (pl.col("tokens_in") + pl.col("tokens_out")).sum().alias("tok"),
                                         pl.len().alias("n"))
        for m, usd, tok, n in agg.iter_rows():
            out[m] = (usd / tok if tok else 0.0, n)
    return out


def pool_document(spec: TableSpec, models: list[str] | None = None,
                  api_base: str = DEFAULT_URL) -> dict[str, Any]:
    """The pool file's content: workers for the recorded models, priced, with train-split skills per task."""
    path = spec.path
    # Taken before the table is read: a change while it is read shows as a mismatch later, never hides.
    written_from = fingerprint(path)
    prices = read_prices(spec.prices) if spec.prices else {}
    raw = read_table(path, ["question", "reference", "response", "model", "correct"])
    # Whether some rows name no task of their own (they take spec.task): recorded for mixed tables.
    untasked = TASK_COLUMN not in raw.columns or raw.select(
        (pl.col(TASK_COLUMN).str.strip_chars() != "").not_().fill_null(True).any()).item()
    t = with_tokens(with_tasks(raw, spec.task, path))
    check_shared_texts(t, path)
    recorded = t.get_column("model").unique(maintain_order=True).to_list()
    if models:
        unknown = [m for m in models if m not in recorded]
        if unknown:
            raise ConductorError(f"--models: {', '.join(unknown)} not recorded in {path} "
                                 f"(recorded: {', '.join(sorted(recorded))})")
        chosen = list(dict.fromkeys(models))
    else:
        chosen = sorted(recorded, key=str.lower)
    # A row's recorded cost_usd is its cost; the others are priced at the pool's price. That is the
    # list price when the price table has the model: one costly recorded row (a retry, a long call)
    # made an effective price of it that charged every other row about 40 times its list price. An
    # effective price serves a model with no list price, or one whose every row is costed (nothing
    # is charged tokens x price then: the price only estimates and reserves, and the recorded
    # dollars do that better than a list price).
    costed = (dict(t.group_by("model").agg(pl.col(COST_COLUMN).is_not_null().all()).iter_rows())
              if COST_COLUMN in t.columns else {})
    effective = {m: v for m, v in effective_prices(t).items() if m not in prices or costed.get(m)}
    n_costed = (dict(t.group_by("model").agg(pl.col(COST_COLUMN).is_not_null().sum()).iter_rows())
                if COST_COLUMN in t.columns else {})
    n_rows = dict(t.group_by("model").len().iter_rows())
    # Each call is charged its recorded cost, unclamped: budgets must reserve the largest one.
    largest = (dict(t.group_by("model").agg(pl.col(COST_COLUMN).max()).drop_nulls().iter_rows())
               if COST_COLUMN in t.columns else {})
    unpriced = [m for m in chosen if m not in prices and m not in effective]
    if unpriced:
        where = f"the price table {spec.prices}" if spec.prices else "no price table (--prices)"
        raise ConductorError(f"replay table {path}: no price for model(s) {', '.join(unpriced)}: not in {where} "
                             f"and no {COST_COLUMN} recorded for their rows; add them to a price table (--prices), "
                             f"record {COST_COLUMN}, or leave them out with --models")
    # Expected accuracy per task from the train split only, never from test: the report is on test.
    tasks_of = {m: sorted(ts) for m, ts in t.group_by("model").agg(pl.col("task").unique()).iter_rows()}
    # A row with no label is no evidence: left out (and counted), never taken for wrong.
    train = (t.filter(pl.col("split") == "train").group_by("model", "task")
             .agg(pl.col("correct").mean().alias("acc"), pl.col("correct").count().alias("n")))
    unlabelled = t.filter((pl.col("split") == "train") & pl.col("correct").is_null()).height
    skill = {(r["model"], r["task"]): (r["acc"], r["n"]) for r in train.to_dicts()}
    # The shared data's provenance only for the shared file itself, never for a table named like it.
    source = SOURCES.get(spec.shared or "") or f"the replay table {path.name}"
    workers, ids = [], set()
    for m in chosen:
        wid = _worker_id(m, ids)
        skills = {task: skill.get((m, task), (None, 0)) for task in tasks_of[m]}
        measured = "; ".join(f"{task} {acc:.3f} over {n}" for task, (acc, n) in skills.items() if acc is not None)
        if m in effective:
            rate, n = effective[m]
            p_in = p_out = rate * 1e6
            price_text = (f"${p_in:.4g} per million tokens, input and output alike: the recorded {COST_COLUMN} "
                          f"of {n} rows divided by their tokens.")
        else:
            p_in, p_out, basis = prices[m]
            price_text = (f"${p_in:g} / ${p_out:g} per million input / output tokens "
                          f"({basis or spec.prices.name})"
                          + (f"; its recorded {COST_COLUMN} is charged on {n_costed[m]} of its {n_rows[m]} rows."
                             if n_costed.get(m) else "."))
        desc = (f"{m}: real recorded responses from {source}. "
                + (f"Train-split accuracy (questions): {measured}. " if measured else "")
                + price_text)
        workers.append({
            "id": wid, "model": f"openai/{m}", "provider": "replay", "api_base": api_base,
            "description": desc,
            "skills": {task: round(float(acc), 4) if acc is not None else None for task, (acc, _) in skills.items()},
            "price": {"input_per_mtok": _sig(p_in), "output_per_mtok": _sig(p_out)},
            **({"max_call_usd": float(largest[m])} if m in largest else {}),
        })
    workers.append({"id": "vote", "kind": "function", "function": "vote",
                    "description": "majority final answer among the granted outputs; a tie goes to the "
                                   "earliest step's answer. Local, free."})
    workers.append({"id": "extract", "kind": "function", "function": "extract",
                    "description": "the final answer of the one granted output. Local, free."})
    tasks = t.get_column("task").unique().sort().to_list()
    replay: dict[str, Any] = {"dataset": spec.name, "table": str(path.resolve()), "fingerprint": written_from,
                              "task": tasks[0] if len(tasks) == 1 else MIXED}
    if replay["task"] == MIXED and spec.task and untasked:
        replay["default_task"] = spec.task
    if spec.prices:
        replay["prices"] = str(Path(spec.prices).resolve())
    replay["split"] = {"salt": SPLIT_SALT, "train_fraction": TRAIN_FRACTION}
    replay["skills"] = "train split, recorded correct labels, per task" + (
        f"; {unlabelled} train row(s) with no label left out" if unlabelled else "")
    n_cost = t.height - t.get_column(COST_COLUMN).null_count() if COST_COLUMN in t.columns else 0
    replay["costs"] = (f"recorded {COST_COLUMN} on {n_cost} of {t.height} rows, else tokens x price" if n_cost
                       else "tokens x price (no recorded cost_usd)")
    return {
        "version": 1,
        "replay": replay,
        "providers": {"replay": {"max_concurrency": 32, "timeout_s": 30, "max_attempts": 3}},
        "workers": workers,
    }


def task_counts(queries: pa.Table) -> str:
    """'task math' or 'tasks choice 300, math 300', for the CLI's one-line summaries."""
    counts = Counter(queries.column("task").to_pylist())
    if len(counts) == 1:
        return f"task {next(iter(counts))}"
    return "tasks " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: str(kv[0])))


HEADER = """\
# Replay pool for {dataset}, written by `conductor replay pool`. Do not commit:
# it points at a replay table on this machine.
#
# Each llm worker answers with a real model's recorded responses, served by
# `conductor replay serve --pool THIS_FILE` (set CONDUCTOR_REPLAY_URL to use
# another port). A step is answered only when its instruction is exactly the
# original question; anything else is a labeled "not recorded" error.
# skills: accuracy per task on the train split only (recorded labels).
# price: the price table's list price; for a model not in it (or whose every row records
# cost_usd), an effective price instead: the sum of its recorded costs (train split)
# divided by the sum of those rows' tokens (recorded, else characters / 4), the same for
# input and output. Budgets reserve and the planner estimates with it; a row with a
# recorded cost_usd is charged that (the replay server sends it with the response),
# any other row its tokens x this price.
# max_call_usd: the model's largest recorded cost_usd; a call reserves at least it.
# fingerprint: the table's size, modification time and SHA-256 when this file was written;
# every command that reads the table through this file refuses it once the table
# changes: write the pool again then.
"""


def write_pool(path: Path, doc: dict[str, Any]) -> Path:
    """Written only when the pool file would load: a bad --api-base must not replace a good file."""
    from conductor.errors import ConductorError, PoolError
    from conductor.pool import parse_pool

    try:
        parse_pool(yaml.safe_load(yaml.safe_dump(doc)), where=str(path))
    except PoolError as e:
        raise ConductorError(f"--out {path}: not written, the pool would not load: {e}") from None
    path = Path(path)
    text = HEADER.format(dataset=doc["replay"]["dataset"]) + "\n" + yaml.safe_dump(
        doc, sort_keys=False, allow_unicode=True, width=100)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:  # /proc/x.yaml, a read-only place, a folder's name
        raise ConductorError(f"--out {path}: cannot write it ({e.strerror or e})") from None
    return path


def _worker_id(model: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.:\-]", "_", model).lstrip("_.:-") or "model"
    wid, n = base, 2
    while wid in taken:
        wid, n = f"{base}_{n}", n + 1
    taken.add(wid)
    return wid


def _sig(x: float) -> float:
    """Six significant digits: a readable pool file, and exact for the list prices."""
    return float(f"{x:.6g}")


def _text(v: Any) -> str | None:
    return None if v is None else str(v)
