"""Query sets and pool files made from a replay table, written under data/ at run time.

The query set: one query per question, prompt = the question exactly as the
models saw it (so the replay server can answer it), query_id = question_id.

The pool file: one llm worker per recorded model ("openai/<model>" at the replay
server's URL), its price imported from prices.csv, its expected accuracy
(`skills`) measured on the train split only, and the local function workers
`vote` and `extract`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pyarrow as pa
import yaml

from conductor.errors import ConductorError
from conductor.queries import SCHEMA
from conductor.replay.tables import (DATASETS, SPLIT_SALT, SPLITS, TRAIN_FRACTION, read_prices, read_table,
                                     table_path)

DEFAULT_URL = "${CONDUCTOR_REPLAY_URL:-http://127.0.0.1:8912/v1}"
SOURCES = {
    "gsm8k": "GSM8K test, zero-shot, JSON-formatted answers (ZeroEval)",
    "mmlu_pro": "MMLU-Pro test sample, 5-shot chain of thought (TIGER-AI-Lab)",
}


def query_table(replay_dir: Path, dataset: str, split: str = "all") -> pa.Table:
    """One query per question of the table (first-appearance order), optionally one split."""
    if split not in SPLITS:
        raise ConductorError(f"--split {split!r}: choose from {', '.join(SPLITS)}")
    path = table_path(replay_dir, dataset)
    cols = ["question_id", "question", "reference"]
    t = read_table(path, cols + (["category"] if dataset == "mmlu_pro" else []))
    qs = t.unique(subset=["question_id"], keep="first", maintain_order=True)
    if split != "all":
        qs = qs.filter(pl.col("split") == split)
    task = DATASETS[dataset]
    rows = qs.to_dicts()
    meta = [orjson.dumps({"dataset": dataset, "category": r.get("category"), "split": r["split"]}).decode()
            for r in rows]
    return pa.table({
        "query_id": [r["question_id"] for r in rows],
        "prompt": [r["question"] for r in rows],
        "task": [task] * len(rows),
        "reference": [r["reference"] for r in rows],
        "metadata": meta,
    }, schema=SCHEMA)


def pool_document(replay_dir: Path, dataset: str, models: list[str] | None = None,
                  api_base: str = DEFAULT_URL) -> dict[str, Any]:
    """The pool file's content: workers for the recorded models, priced, with train-split skills."""
    path = table_path(replay_dir, dataset)
    prices = read_prices(Path(replay_dir) / "prices.csv")
    t = read_table(path, ["model", "correct"])
    recorded = t.get_column("model").unique(maintain_order=True).to_list()
    if models:
        unknown = [m for m in models if m not in recorded]
        if unknown:
            raise ConductorError(f"--models: {', '.join(unknown)} not recorded in {path} "
                                 f"(recorded: {', '.join(sorted(recorded))})")
        chosen = list(dict.fromkeys(models))
    else:
        chosen = sorted(recorded, key=str.lower)
    unpriced = [m for m in chosen if m not in prices]
    if unpriced:
        raise ConductorError(f"{Path(replay_dir) / 'prices.csv'} has no price for {', '.join(unpriced)}; "
                             f"add it there or leave the model out with --models")
    # Expected accuracy from the train split only, never from test: the report is on test.
    train = (t.filter(pl.col("split") == "train").group_by("model")
             .agg(pl.col("correct").mean().alias("acc"), pl.len().alias("n")))
    skill = {r["model"]: (r["acc"], r["n"]) for r in train.to_dicts()}
    task = DATASETS[dataset]
    workers, ids = [], set()
    for m in chosen:
        wid = _worker_id(m, ids)
        p_in, p_out, basis = prices[m]
        acc, n = skill.get(m, (None, 0))
        desc = (f"{m}: real recorded responses to {SOURCES[dataset]}. "
                + (f"Train-split accuracy {acc:.3f} over {n} questions. " if acc is not None else "")
                + f"${p_in:g} / ${p_out:g} per million input / output tokens ({basis or 'prices.csv'}).")
        workers.append({
            "id": wid, "model": f"openai/{m}", "provider": "replay", "api_base": api_base,
            "description": desc,
            "skills": {task: round(float(acc), 4) if acc is not None else None},
            "price": {"input_per_mtok": p_in, "output_per_mtok": p_out},
        })
    workers.append({"id": "vote", "kind": "function", "function": "vote",
                    "description": "majority final answer among the granted outputs; a tie goes to the "
                                   "earliest step's answer. Local, free."})
    workers.append({"id": "extract", "kind": "function", "function": "extract",
                    "description": "the final answer of the one granted output. Local, free."})
    return {
        "version": 1,
        "replay": {
            "dataset": dataset,
            "table": str(path.resolve()),
            "task": task,
            "prices": str((Path(replay_dir) / "prices.csv").resolve()),
            "split": {"salt": SPLIT_SALT, "train_fraction": TRAIN_FRACTION},
            "skills": "train split, recorded correct labels",
        },
        "providers": {"replay": {"max_concurrency": 32, "timeout_s": 30, "max_attempts": 3}},
        "workers": workers,
    }


HEADER = """\
# Replay pool for {dataset}, written by `conductor replay pool`. Do not commit:
# it points at the shared replay data on this machine.
#
# Each llm worker answers with a real model's recorded responses, served by
# `conductor replay serve --pool THIS_FILE` (set CONDUCTOR_REPLAY_URL to use
# another port). A step is answered only when its instruction is exactly the
# original question; anything else is a labeled "not recorded" error.
# price: imported from prices.csv. skills: accuracy on the train split only.
"""


def write_pool(path: Path, doc: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = HEADER.format(dataset=doc["replay"]["dataset"]) + "\n" + yaml.safe_dump(
        doc, sort_keys=False, allow_unicode=True, width=100)
    path.write_text(text, encoding="utf-8")
    return path


def _worker_id(model: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.:\-]", "_", model).lstrip("_.:-") or "model"
    wid, n = base, 2
    while wid in taken:
        wid, n = f"{base}_{n}", n + 1
    taken.add(wid)
    return wid
