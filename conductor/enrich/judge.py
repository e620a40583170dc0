"""The optional LLM judge: a pool worker scores records that have no reference,
by the rubric in the job file (`quality.judge: {worker, rubric}`).

Its calls are a run of their own (`<run_id>-judge`) through the same executor,
cache, budgets and traces; each answer is a validated record
`{score: 0..1, reason}`. Reused records keep the score they were given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from conductor.fields import Field, object_schema
from conductor.enrich.job import Job
from conductor.records import RecordChecker
from conductor.execute.structured import RecordSpec
from conductor.store import RunDir, write_table

FIELDS = (Field("score", "number", "how well the record meets the rubric, from 0 (not at all) to 1 (fully)", True),
          Field("reason", "string", "one sentence on the score", True))


def judge_prompt(rubric: str, prompt: str, record: dict[str, Any]) -> str:
    return (f"You are reviewing a record extracted from a document.\n\nRubric:\n{rubric.strip()}\n\n"
            f"The request the record answers:\n{prompt}\n\n"
            f"The record:\n{orjson.dumps(record, default=str, option=orjson.OPT_INDENT_2).decode()}\n\n"
            f"Score the record against the rubric.")


def judge(job: Job, run: RunDir, data_dir: Path, items: list[tuple[str, str, dict[str, Any]]],
          progress: bool, budget_usd: float | None = None, refresh: bool = False
          ) -> tuple[dict[str, tuple[float | None, str | None]], float, int]:
    """Score (id, prompt, record) items within `budget_usd`; returns (id -> (score, reason),
    what the judge cost, items a budget stopped). `refresh` (--full-refresh) asks the judge
    again rather than the response cache."""
    from conductor.enrich.direct import DirectPlanner
    from conductor.runner import RunConfig, execute_stage, plan_stage, prepare

    spec = job.quality["judge"]
    jrun = RunDir(data_dir, f"{run.run_id}-judge")
    queries = jrun.path / "queries.parquet"
    if not queries.exists():
        write_table(queries, pa.table({
            "query_id": pa.array([i for i, _, _ in items], pa.string()),
            "prompt": pa.array([judge_prompt(spec.get("rubric") or "", p, r) for _, p, r in items], pa.string()),
            "task": pa.array(["record"] * len(items), pa.string()),
            "reference": pa.nulls(len(items), pa.string()),
            "metadata": pa.nulls(len(items), pa.string()),
        }))
    cfg = RunConfig(queries=queries, pool=job.pool_path, data_dir=data_dir, run_id=jrun.run_id, seed=job.seed,
                    budget_usd=budget_usd, progress=progress, refresh=refresh)
    prepared = prepare(cfg)
    plan_stage(prepared, DirectPlanner(spec["worker"]))
    schema = object_schema(FIELDS, strict=True)
    execute_stage(prepared, record=RecordSpec(f"{job.name}_judge", schema, RecordChecker(schema), job.structured))
    results = pq.read_table(jrun.table("results"), columns=["query_id", "status", "final_answer", "cost_usd"])
    checker = RecordChecker(schema)
    out: dict[str, tuple[float | None, str | None]] = {}
    for r in results.to_pylist():
        rec, _ = checker.check(r["final_answer"]) if r["status"] == "ok" else (None, None)
        out[r["query_id"]] = ((min(1.0, max(0.0, float(rec["score"]))), rec["reason"]) if rec else (None, None))
    stopped = sum(s == "budget_exhausted" for s in results.column("status").to_pylist())
    jrun.set_status("incomplete" if stopped else "complete", judge_of=run.run_id)
    return out, pc.sum(results.column("cost_usd")).as_py() or 0.0, stopped
