"""The optional LLM judge: a pool worker scores records that have no reference (a
plain-text job's replies: its `text`), by the rubric in the job file
(`quality.judge: {worker, rubric}`).

Its calls are a run of their own (`<run_id>-judge`) through the same executor,
cache, budgets and traces; each answer is a validated record
`{score: 0..1, reason}`. A score outside 0..1 (a judge that answers on a 1-10
scale) is an invalid reply like any other: it gets the one repair, and if that is
out of range too the record has no judge score, and `judge_reason` says why.
Nothing is clamped. The judge run's manifest gets a summary (`cost_usd`, `calls`, ...), so
the catalog's `runs` view counts its spend.

Each answer is stored with `judge_hash`, a digest of what decided the judge's
request (see `judge_hash`): a reused record is judged again, and keeps its record,
when its digest is not the current one (another rubric or judge worker, or null:
never judged, its call failed, or written before the digest existed).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from conductor.fields import Field, object_schema
from conductor.enrich.job import Job
from conductor.pool import Pool
from conductor.records import RecordChecker
from conductor.execute.structured import RecordSpec
from conductor.store import RunDir, write_table

FIELDS = (Field("score", "number", "how well the record meets the rubric, from 0 (not at all) to 1 (fully)", True),
          Field("reason", "string", "one sentence on the score", True))


def judge_schema() -> dict[str, Any]:
    """The judge's record, sent and checked: `score` bounded to 0..1, so a reply out of that
    range is invalid (repaired once), and a structured-output provider keeps it in range."""
    schema = object_schema(FIELDS, strict=True)
    schema["properties"]["score"].update(minimum=0, maximum=1)
    return schema


def judge_prompt(rubric: str, prompt: str, record: dict[str, Any] | str | None) -> str:
    """The judge's request for one row: a typed job's record (a dict), or a plain-text job's
    reply (its text, as the records' `text` column holds it)."""
    if isinstance(record, dict):
        return (f"You are reviewing a record extracted from a document.\n\nRubric:\n{rubric.strip()}\n\n"
                f"The request the record answers:\n{prompt}\n\n"
                f"The record:\n{orjson.dumps(record, default=str, option=orjson.OPT_INDENT_2).decode()}\n\n"
                f"Score the record against the rubric.")
    return (f"You are reviewing a reply written for a request.\n\nRubric:\n{rubric.strip()}\n\n"
            f"The request:\n{prompt}\n\n"
            f"The reply:\n{record or ''}\n\n"
            f"Score the reply against the rubric.")


def judge_hash(job: Job, pool: Pool) -> str:
    """What decides the judge's request besides the row's own prompt and record: the rubric and
    the prompt template (rendered around placeholders), the record schema and how it is asked
    for (`structured`), and the judge worker's model, endpoint and parameters. A score given
    under another digest is not this judge's: the record is judged again (not extracted again)."""
    spec = job.quality["judge"]
    w = pool.worker(spec["worker"])
    # a typed job's template as it always was (its records' digests stay), a plain-text job's its own
    shown = {"\x00record\x00": None} if job.fields else "\x00record\x00"
    ident = {"template": judge_prompt(spec.get("rubric") or "", "\x00prompt\x00", shown),
             "schema": judge_schema(), "structured": job.structured,
             "worker": [w.id, w.kind, w.model, w.api_base, w.params, w.system, w.function], "replay": pool.replay}
    return hashlib.sha256(orjson.dumps(ident, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def judge(job: Job, run: RunDir, data_dir: Path, items: list[tuple[str, str, dict[str, Any] | str | None]],
          progress: bool, budget_usd: float | None = None, refresh: bool = False
          ) -> tuple[dict[str, tuple[float | None, str, bool]], float, int]:
    """Score (id, prompt, record) items within `budget_usd` (a plain-text job's record is its
    text); returns (id -> (score, reason, answered), what the judge cost, items a budget
    stopped). An id a budget stopped is left out of the mapping: it was not judged. `answered`
    is False when the call failed (an error, not the judge's answer: the next run asks again);
    an answer that is not a valid record even after the repair (a score outside 0..1, say) is
    the judge's answer, (None, why, True): asking the same request again would get the same
    reply from the response cache. `refresh`
    (--full-refresh) asks the judge again rather than the response cache. The judge's run gets
    a summary in its manifest, as every run does (its `cost_usd` and `calls` in the catalog's
    `runs` view: SQL totals over runs left the judge's spend out, audit60 F9)."""
    import time

    from conductor.enrich.direct import DirectPlanner
    from conductor.runner import RunConfig, execute_stage, plan_stage, prepare

    t0 = time.monotonic()
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
    schema = judge_schema()
    checker = RecordChecker(schema)
    execute_stage(prepared, record=RecordSpec(f"{job.name}_judge", schema, checker, job.structured))
    results = pq.read_table(jrun.table("results"), columns=["query_id", "status", "final_answer", "error",
                                                             "cost_usd"])
    out: dict[str, tuple[float | None, str, bool]] = {}
    stopped = 0
    for r in results.to_pylist():
        status, error = r["status"], r["error"] or r["status"]
        if status == "budget_exhausted":
            stopped += 1
            continue  # not judged: a record keeps what it had, and the next run judges it
        rec, why = checker.check(r["final_answer"]) if status == "ok" else (None, error)
        if rec is not None:
            out[r["query_id"]] = (float(rec["score"]), rec["reason"], True)
        elif status in ("ok", "invalid") or "not a valid record" in error:
            out[r["query_id"]] = (None, f"no valid judge reply: {why}", True)
        else:
            out[r["query_id"]] = (None, f"the judge's call failed ({status}): {why}", False)
    summary = _summary(job, run, jrun, prepared.queries.num_rows, sum(a for _, _, a in out.values()), stopped,
                       time.monotonic() - t0)
    jrun.set_status("incomplete" if stopped else "complete", judge_of=run.run_id, summary=summary)
    return out, summary["cost_usd"], stopped


def _summary(job: Job, run: RunDir, jrun: RunDir, queries: int, answered: int, stopped: int,
             wall: float) -> dict[str, Any]:
    """The judge run's summary, kept in its manifest as `conductor run` keeps its own (not in a
    summary.json: a glob over `runs/<job>-*/summary.json` reads the job's runs only), with the
    keys `runner.report_stage` gives the same things: `cost_usd` and `calls` above all, so that
    totals over the `runs` view count the judge; `judged` (records it answered) and
    `budget_exhausted` (records a budget left unjudged) are its own."""
    from conductor.execute.context import lost_in_flight
    from conductor.stats import run_totals

    t = run_totals(jrun.path)
    manifest = jrun.read_manifest()
    before = (manifest.get("summary") or {}).get("wall_time_s")  # a resumed judge run: every command's time
    return {
        "run_id": jrun.run_id, "judge_of": run.run_id, "job": job.name, "queries": queries,
        "plans": t.plans, "valid_plans": t.valid_plans, "statuses": t.statuses, "calls": t.calls,
        "cache_hits": t.cache_hits, "cost_usd": t.cost_usd,
        "cost_per_query_usd": t.cost_usd / queries if queries else None,
        "plans_without_price": t.plans_without_price,
        "tokens_per_query": t.tokens / queries if queries else None,
        "judged": answered, "budget_exhausted": stopped,
        "wall_time_s": round(wall + (before or 0.0), 3), "spend": manifest.get("spend", []),
        "lost_in_flight": lost_in_flight(manifest), "outputs": str(jrun.path),
    }
