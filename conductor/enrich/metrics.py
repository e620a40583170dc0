"""Quality of a job's records.

With references: per field, the mean score over rows whose reference is not null
(a row without a valid record scores 0), plus the scorer's extras (TAT-QA's em
and f1, set's jaccard); overall, the mean over those rows of the row's score
(the mean of its scored fields). Always: the share of rows with a valid record,
per field the share of valid records where it is null, and the mean confidence
where the workflow gave one. With a judge: the mean judge score over records
scored under the current judge definition.
"""

from __future__ import annotations

from statistics import fmean
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from conductor.enrich.job import Job
from conductor.enrich.score import reference_value, score_field


def field_scores(job: Job, df: pl.DataFrame, records: list[dict[str, Any] | None]) -> dict[str, list]:
    """Per referenced field, per row: the scorer's result ({"score": ..., ...}) or None (no reference)."""
    by_name = {f.name: f for f in job.fields}
    out = {}
    for name, ref in job.references.items():
        gold = df.get_column(ref.column).to_list()
        scales = df.get_column(ref.scale_column).to_list() if ref.scale_column else [None] * df.height
        types = df.get_column(ref.type_column).to_list() if ref.type_column else [None] * df.height
        col = []
        for i, rec in enumerate(records):
            g = reference_value(by_name[name], gold[i])
            pred = rec.get(name) if rec is not None else None
            pred_scale = (rec.get(ref.scale_field) if rec is not None else None) if ref.scale_field else ""
            col.append(score_field(ref.score, pred, g, rel_tol=ref.rel_tol, pred_scale=pred_scale,
                                   gold_scale=scales[i] or "", gold_type=types[i]))
        out[name] = col
    return out


def row_scores(job: Job, df: pl.DataFrame, records: list[dict[str, Any] | None]) -> list[float | None]:
    """Per row, the mean score of its fields that have a reference; None when none has one."""
    per = field_scores(job, df, records)
    out = []
    for i in range(len(records)):
        got = [per[name][i]["score"] for name in per if per[name][i] is not None]
        out.append(fmean(got) if got else None)
    return out


def metrics(job: Job, df: pl.DataFrame, records: list[dict[str, Any] | None], table: pa.Table,
            judge_hash: str | None = None) -> dict[str, Any]:
    """The job's metrics. With a judge, `judge_hash` is the current judge definition's digest:
    the mean judge score is over scores given under it, and scores kept from another definition
    (a budget stopped their re-judging) are counted apart, as `stale_rows`."""
    n = table.num_rows
    valid = [r for r in records if r is not None]
    ok = pc.sum(pc.equal(table.column("status"), "ok").cast(pa.int64())).as_py() or 0
    out: dict[str, Any] = {"rows": n, "valid_share": ok / n if n else 0.0, "fields": {}}
    per = field_scores(job, df, records) if job.references else {}
    for f in job.fields:
        m: dict[str, Any] = {"null_share": (sum(r.get(f.name) is None for r in valid) / len(valid)) if valid else None}
        conf = f"{f.name}_confidence"
        if conf in table.column_names:
            m["mean_confidence"] = pc.mean(table.column(conf)).as_py()
        if f.name in per:
            scored = [s for s in per[f.name] if s is not None]
            m["scored_rows"] = len(scored)
            m["accuracy"] = fmean(s["score"] for s in scored) if scored else None
            for extra in ("em", "f1", "jaccard"):
                vals = [s[extra] for s in scored if extra in s]
                if vals:
                    m[extra] = fmean(vals)
        out["fields"][f.name] = m
    if "judge_score" in table.column_names:
        scores = table.column("judge_score").to_pylist()
        hashes = (table.column("judge_hash").to_pylist() if judge_hash is not None and "judge_hash" in
                  table.column_names else [judge_hash] * n)
        judged = [s for s, h in zip(scores, hashes) if s is not None and h == judge_hash]
        # Scores kept from another judge definition (a budget stopped their re-judging): not this judge's.
        stale = sum(s is not None and h != judge_hash for s, h in zip(scores, hashes))
        out["judge"] = {"mean_score": fmean(judged) if judged else None, "judged_rows": len(judged),
                        "stale_rows": stale}
    if job.references:
        scores = [s for s in (table.column("score").to_pylist() if "score" in table.column_names else []) if s is not None]
        out["overall"] = fmean(scores) if scores else None
        out["scored_rows"] = len(scores)
    return out
