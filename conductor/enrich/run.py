"""Running a job: only new or changed rows are sent; the rest keep their records.

A row's record is reused (at $0, no call) when an earlier run of the same job
with the same definition holds a valid record for its id with the same content
hash (the columns the template reads, plus the job definition). Rows to compute
go through the ordinary run machinery (plan, execute with the cache, budgets,
journal and traces), so an enrichment run is also a run in the catalog. The
run's records.parquet holds every input row: the id, the carried columns, one
typed column per field, status, error, cost and calls, per-field confidence
where the workflow had several record-producing steps, and the row's score
where references exist. With a judge, each valid record without a reference also
gets `judge_score`, `judge_reason` and `judge_hash` (the digest of the judge
definition that gave the score): a reused record whose digest is not the current
judge's is judged again, without being extracted again.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from conductor import schemas
from conductor.enrich.context import check_budget, check_context, check_planned_context
from conductor.enrich.history import (ABANDONED, OK, abandon_interrupted, interrupted_run, invalid_before,
                                      previous_records, read_table)
from conductor.enrich.job import Job
from conductor.enrich.metrics import metrics as compute_metrics, row_scores
from conductor.records import RecordChecker, parse_reply, typed_columns
from conductor.enrich.table import ids_of, load_rows, references, render, row_hashes
from conductor.errors import ConductorError
from conductor.execute.context import add_lost, lost_in_flight
from conductor.execute.structured import RecordSpec
from conductor.pool import Pool, load_pool
from conductor.progress import Progress
from conductor.rewards import group_advantages
from conductor.store import RunDir, check_data_dir, damage_advice, rows_to_table, write_atomic, write_table

TS = pa.timestamp("us", tz="UTC")
# A row's status: OK ("ok", a valid record), invalid (no valid record after one repair), error,
# budget_exhausted (a rerun finishes it) or invalid_plan, as in results.parquet.
__all__ = ["OK", "run_job"]


def run_job(job: Job, *, data_dir: str | Path = "data", run_id: str | None = None, full_refresh: bool = False,
            progress: bool = True, keep_work: bool = False) -> dict[str, Any]:
    """Run a job and return its summary (also written to the run's summary.json). One process
    per job and data folder: a second one would compute, and pay for, the same rows. Once the
    run is complete its work/ folders (the journal, about ten times the size of the outputs) are
    removed unless `keep_work`: nothing reads them again."""
    from conductor.execute.lock import run_lock
    from conductor.runids import RUN_ID_RULE, valid_run_id

    if run_id is not None and not valid_run_id(run_id):  # before anything is written under it
        raise ConductorError(f"--run-id {run_id!r}: {RUN_ID_RULE}")
    check_data_dir(data_dir)
    with run_lock(Path(data_dir) / ".locks" / f"job-{job.name}", f"of job {job.name}"):
        return _run_job(job, data_dir=data_dir, run_id=run_id, full_refresh=full_refresh, progress=progress,
                        keep_work=keep_work)


def _run_job(job: Job, *, data_dir: str | Path, run_id: str | None, full_refresh: bool,
             progress: bool, keep_work: bool) -> dict[str, Any]:
    t0 = time.monotonic()
    data_dir = Path(data_dir)
    pool = load_pool(job.pool_path)
    definition = job.definition_hash(job.pool_identity(pool))
    say = Progress(label="job", enabled=progress).say
    say(f"reading {job.input_path}")
    df = load_rows(job)
    ids = ids_of(job, df)
    prompts = render(job, df)
    hashes = row_hashes(job, df, definition)
    raw_ids = df.get_column(job.id_column).to_list()  # as the input holds them, for the refusals
    check_context(job, pool, raw_ids, prompts)
    now = datetime.now(timezone.utc)
    info = {"name": job.name, "path": str(job.path.resolve()), "id_column": job.id_column,
            "definition": definition, "full_refresh": full_refresh}
    if run_id is not None and (kept := _as_it_was(RunDir(data_dir, run_id), job, info, ids, hashes)) is not None:
        from conductor.runner import catalog_line

        kept["catalog"] = catalog_line(data_dir)
        return kept

    previous = {} if full_refresh else previous_records(data_dir, job, definition, exclude=run_id)
    judging = bool(job.quality.get("judge"))  # a plain-text job's replies are judged too (audit60 F3)
    current_judge = None
    if judging:
        from conductor.enrich.judge import judge_hash

        current_judge = judge_hash(job, pool)
    retry = set() if full_refresh else invalid_before(data_dir, job, definition, run_id, dict(zip(ids, hashes)))
    reuse = [i for i, (rid, h) in enumerate(zip(ids, hashes)) if previous.get(rid, {}).get("row_hash") == h]
    reused = set(reuse)
    todo = [i for i in range(len(ids)) if i not in reused]
    # the rows it sends only: a run reusing every row calls no extraction worker (it may only rescore)
    check_budget(job, pool, [raw_ids[i] for i in todo], [prompts[i] for i in todo])
    say(f"{len(ids):,} rows: {len(todo):,} to compute, {len(reuse):,} reused")
    run_id = (run_id or interrupted_run(data_dir, info, [ids[i] for i in todo], pool)
              or f"{job.name}-{now.strftime('%Y%m%dT%H%M%S%f')}")
    run = RunDir(data_dir, run_id)
    _check_resumable(run, info, [ids[i] for i in todo])
    resumed = _resumed(run) if todo else None
    if resumed:
        say(_resuming_line(run_id, resumed))
    made = [r.path for r in (RunDir(data_dir, f"{run_id}-judge"), run) if not r.path.exists()]
    made += [] if (data_dir / "runs").exists() else [data_dir / "runs"]
    abandoned: list[dict[str, Any]] = []

    def close_interrupted() -> None:
        # Once this run's manifest names the job: a batch handed over to a run refused before that
        # sat in a folder no rerun finds, and the rerun paid for those rows again (audit51 N1).
        abandoned.extend(abandon_interrupted(data_dir, job.name, run_id))

    computed: dict[str, dict[str, Any]] = {}
    judge_cost, judge_stopped = 0.0, 0
    try:
        if todo:
            computed, plans = _compute(job, pool, df, ids, prompts, todo, run, data_dir, progress, info, retry,
                                       on_prepared=close_interrupted)
            _write_rewards(job, df, ids, run, plans)
        else:
            if not run.exists():  # naming the job: killed while judging, a later run closes it and its judge run
                run.write_manifest({"run_id": run_id, "status": "created", "created_at": now.isoformat(), "job": info})
            close_interrupted()
        if judging:
            judge_cost, judge_stopped = _judge(job, df, ids, prompts, todo, computed, reuse, previous, run,
                                               data_dir, progress, current_judge, full_refresh)
    except ConductorError as e:
        _remove_if_nothing_sent(made)
        if run.path in made and not run.path.exists():  # its plans went with it: do not say they are saved,
            # nor how to resume the run (NotReady's advice)
            raise ConductorError(getattr(e, "without_advice", str(e)).replace("plans are saved; ", "")) from None
        raise

    say("writing records")
    rows = _row_outcomes(ids, computed, previous, reused, run_id)
    records = [r["record"] for r in rows]
    table = _records_table(job, df, ids, hashes, rows, records, now)
    write_table(run.table("records"), table)
    summary = _summary(job, table, run, len(todo), len(reuse), time.monotonic() - t0,
                       compute_metrics(job, df, records, table, judge_hash=current_judge))
    summary["judge_cost_usd"] = judge_cost
    summary["judge_budget_exhausted"] = judge_stopped
    summary["failures"], summary["failures_not_shown"] = record_failure_groups(table)
    summary["lost_in_flight"] = _lost_in_flight(run, RunDir(data_dir, f"{run_id}-judge"))
    summary["abandoned_runs"] = abandoned
    # as `conductor run` has it (a bool), and what the interrupted run had answered before this command
    summary["resumed"], summary["resumed_kept"] = resumed is not None, resumed
    # as `conductor run` counts it: rows a budget stopped are not failed (exit 3 says so)
    stopped = summary["statuses"].get("budget_exhausted", 0)
    summary["failed_share"] = (summary["failed"] - stopped) / summary["rows"] if summary["rows"] else 0.0
    summary["exit_code"] = exit_code(job, summary)
    write_atomic(run.path / "summary.json", orjson.dumps(summary, option=orjson.OPT_INDENT_2, default=str))
    statuses = summary["statuses"]
    complete = not (statuses.get("budget_exhausted") or judge_stopped)
    run.set_status("complete" if complete else "incomplete", summary=summary, job=info)
    if complete and not keep_work:
        _remove_work([run, RunDir(data_dir, f"{run_id}-judge")], say)
    from conductor.runner import catalog_line

    summary["catalog"] = catalog_line(data_dir)
    return summary


def _as_it_was(run: RunDir, job: Job, info: dict[str, Any], ids: list[str],
               hashes: list[str]) -> dict[str, Any] | None:
    """`--run-id` of a complete run: its summary as it was, executing and writing nothing, as
    `conductor run` keeps a complete run (rewritten, it took a newer run's records as reused
    ones, and its spend dropped to $0 in the `runs` view). None when the run is not complete:
    it is made, or resumed. A complete run of another job, definition or rows is refused, and so
    is an abandoned run: rewritten, what it paid left the `runs` view (audit66 F2). How the run
    was made (--full-refresh or not) does not matter to look at it; the flag given with the id
    of a run made without it asks to recompute it in place, which is refused (audit66 F5)."""
    manifest = run.read_manifest() if run.exists() else {}
    status = manifest.get("status")
    if status == ABANDONED:
        by = (manifest.get("summary") or {}).get("superseded_by")
        raise ConductorError(f"run {run.run_id} already exists at {run.path}, abandoned: an interrupted run "
                             + (f"that run {by} superseded" if by else "no rerun can continue")
                             + ", with what it paid in its summary; it is kept as it is: choose another --run-id "
                               "(or omit it)")
    if status != "complete":
        return None
    had = manifest.get("job")
    if not had:  # `conductor run`'s run, or a judge's
        raise ConductorError(f"run {run.run_id} already exists at {run.path} and is not a run of job {job.name}; "
                             f"choose another --run-id (or omit it)")
    what = _other(had, info)
    if what is None and info["full_refresh"] and not had.get("full_refresh"):
        raise ConductorError(f"run {run.run_id} already exists at {run.path}, complete, made without --full-refresh; "
                             f"it is kept as it is, and --full-refresh would recompute it in place: to recompute "
                             f"every row, omit --run-id (a new run) or choose a new one")
    if what is None:
        t = read_table(run.table("records"), [job.id_column, "row_hash"])
        same = (job.id_column in t.column_names and "row_hash" in t.column_names
                and [str(v) for v in t.column(job.id_column).to_pylist()] == ids
                and t.column("row_hash").to_pylist() == hashes)
        if same:
            from conductor.store import load_manifest

            path = run.path / "summary.json"
            try:
                return {**load_manifest(path), "kept": True}
            except (OSError, ValueError) as e:
                raise ConductorError(f"{path} is damaged ({e}); {damage_advice(path)}") from None
        what = "other rows"
    raise ConductorError(f"run {run.run_id} already exists at {run.path}, complete, for {what}; it is kept as it "
                         f"is: choose another --run-id (or omit it)")


def _other(had: dict[str, Any], info: dict[str, Any]) -> str | None:
    """What an existing run of a job was made for, when not this job's definition; None if it is."""
    if had.get("name") != info["name"]:
        return f"job {had.get('name')!r}"
    if had.get("definition") != info["definition"]:
        return f"job {had.get('name')!r} with another definition (template, fields, worker or settings)"
    return None


def _check_resumable(run: RunDir, info: dict[str, Any], todo: list[str]) -> None:
    """An existing run that asked for rows (it has a query set) is continued only by the same job,
    definition, --full-refresh setting and rows to compute. Any other run under its id would drop
    its answers, and what it paid, from the `runs` view; with no row to compute as well (every row
    reused from a newer run), which skipped this check (audit66 F2)."""
    queries = run.path / "queries.parquet"
    if not queries.exists():
        return
    had = (run.read_manifest().get("job") or {}) if run.exists() else {}  # none: killed before it was written
    other = _other(had, info) if had else None
    have = read_table(queries, ["query_id"]).column(0).to_pylist()
    if other or have != todo:
        raise ConductorError(f"run {run.run_id} already exists at {run.path} for {other or 'other rows'}; it is "
                             f"kept as it is (its answers are not this command's): choose another --run-id "
                             f"(or omit it)")
    if had and bool(had.get("full_refresh")) != info["full_refresh"]:
        begun = "with" if had.get("full_refresh") else "without"
        raise ConductorError(f"run {run.run_id} already exists at {run.path}, begun {begun} --full-refresh; rerun "
                             f"the command {begun} --full-refresh to resume it, or choose another --run-id "
                             f"(or omit it) for a new run")


def _resumed(run: RunDir) -> dict[str, Any] | None:
    """What the interrupted run this command continues had done, from its journal: said when it
    resumes, as `conductor run` marks a resumed run (a rerun after Ctrl-C said nothing of it,
    audit66 F4). None for a new run."""
    from conductor.execute.journal import load_state

    if not (run.path / "queries.parquet").exists():
        return None
    state = load_state(run.work)
    return {"plans_finished": len(state.finished), "calls": len(state.paid),
            "cost_usd": round(sum(state.spent.values()), 9)}


def _resuming_line(run_id: str, r: dict[str, Any]) -> str:
    return (f"resuming interrupted run {run_id}: {r['calls']} call(s) answered there (${r['cost_usd']:.6f}) and "
            f"{r['plans_finished']} finished plan(s) are kept, not asked again")


def _remove_if_nothing_sent(made: list[Path]) -> None:
    """A refusal before any call (a setting the runner refuses, a worker without a price under a
    budget, a prompt too long for the worker a plan gives it) removes the folders this attempt
    made: left behind, a run folder held a query set and no manifest, and `conductor sql` could
    not read the catalog, or a manifest whose settings the corrected rerun's differed from, and
    that rerun was refused for a --run-id the user never gave. A journal (*.jsonl) means a call
    may have been sent: that folder stays, and the rerun resumes it. `made`: the judge's run
    folder, then the job run's (which stays with a judge run that stays), then runs/."""
    import shutil

    for p in made:
        if p.name == "runs":
            try:
                p.rmdir()  # only if empty: another job's run may be in it by now
            except OSError:
                pass
        elif p.exists() and next(p.rglob("*.jsonl"), None):
            return
        else:
            shutil.rmtree(p, ignore_errors=True)


def _remove_work(runs: list[RunDir], say) -> None:
    """Delete the journals of complete runs. A rerun starts a new run that reuses their records
    (and asks again, past the cache, for rows whose record was invalid), and `--run-id` of a
    complete run executes and writes nothing (`_as_it_was`), so the journal only takes disk:
    892 MB for a 400,000-row run, against 78 MB of outputs. An incomplete run (stopped by a
    budget) keeps it, as a run would."""
    import shutil

    freed = 0
    for r in runs:
        if not r.work.is_dir():
            continue
        size = sum(f.stat().st_size for f in r.work.rglob("*") if f.is_file())
        try:
            shutil.rmtree(r.work)
        except OSError as e:  # the records are written: a journal left behind costs disk, not data
            say(f"could not remove {r.work} ({e.strerror or e}); it is safe to delete")
            continue
        freed += size
    if freed:
        say(f"removed the run's work folder ({freed / 1e6:,.1f} MB; --keep-work keeps it)")


# ---- rows to compute --------------------------------------------------------

def _compute(job: Job, pool: Pool, df: pl.DataFrame, ids: list[str], prompts: list[str], todo: list[int],
             run: RunDir, data_dir: Path, progress: bool, info: dict[str, Any], retry: set[str] = frozenset(),
             on_prepared=lambda: None):
    """Plan and execute the rows in `todo`; returns (id -> outcome, per-plan rows for rewards).
    `on_prepared()` runs once the run's manifest names the job, before any call.
    With --full-refresh (`info`) cached responses are ignored, so every row is asked again;
    the rows in `retry` (an invalid record last time: the cache holds that reply) are asked
    again in any case, every step of their plans (the executor refreshes whole rows)."""
    from conductor.enrich.direct import DirectPlanner
    from conductor.runner import RunConfig, close_planner, configured_planner, execute_stage, plan_stage, prepare

    queries = run.path / "queries.parquet"
    if not queries.exists():  # else resuming: _check_resumable found the same job, definition and rows
        sub = df[todo]
        write_table(queries, pa.table({
            "query_id": pa.array([ids[i] for i in todo], pa.string()),
            "prompt": pa.array([prompts[i] for i in todo], pa.string()),
            "task": pa.array(["record" if job.fields else None] * len(todo), pa.string()),
            "reference": pa.array(references(job, sub), pa.string()),
            "metadata": pa.nulls(len(todo), pa.string()),
        }))
    options = {k: v for k, v in job.planner.items() if k != "name"}
    cfg = RunConfig(queries=queries, pool=job.pool_path, data_dir=data_dir, run_id=run.run_id,
                    samples=job.samples, planner=job.planner.get("name", "embedded") if job.mode == "planned"
                    else "embedded", planner_options=options if job.mode == "planned" else {},
                    seed=job.seed, max_steps=job.max_steps, budget_usd=job.budget_usd,
                    refresh=info["full_refresh"], progress=progress)
    prepared = prepare(cfg)
    run.set_status(run.read_manifest().get("status", "created"), job=info)  # an interrupted run is found by it
    on_prepared()
    planner = DirectPlanner(job.worker) if job.mode == "direct" else configured_planner(cfg)
    spec = None
    if job.fields:
        spec = RecordSpec(job.name, job.schema, RecordChecker(job.check_schema), job.structured)
    try:
        plan_stage(prepared, planner)
        if job.mode == "planned":
            check_planned_context(job, pool, prepared, dict(zip(ids, df.get_column(job.id_column).to_list())))
        execute_stage(prepared, planner=planner if job.mode == "planned" else None, record=spec,
                      refresh=frozenset(retry))
    finally:
        if job.mode == "planned":
            close_planner(planner)
    return _outcomes(job, pool, run)


def _lost_in_flight(run: RunDir, judge_run: RunDir) -> dict[str, Any]:
    """The job's calls sent and never answered (maybe billed): extraction's and the judge's, whose
    run is its own and whose work folder a complete job removes."""
    judged = lost_in_flight(judge_run.read_manifest()) if judge_run.exists() else {}
    return add_lost(lost_in_flight(run.read_manifest()), judged)


def _judge(job: Job, df: pl.DataFrame, ids: list[str], prompts: list[str], todo: list[int], computed: dict,
           reuse: list[int], previous: dict, run: RunDir, data_dir: Path, progress: bool,
           current: str, refresh: bool = False) -> tuple[float, int]:
    """Have the judge score the valid records (a plain-text job's replies) of rows without any
    reference value: this run's,
    and reused ones not judged under the current judge definition: their `judge_hash` differs
    from `current` (the rubric, the judge worker or its model or parameters changed) or is null
    (a budget or a failed call kept them from being judged, or they were written before
    `judge_hash` existed, so their score cannot be told apart). Those are judged again, not
    extracted again. A record the judge answered under `current`, even with an invalid reply,
    is not asked again: the response cache holds the same reply. The judge spends what the
    job's budget_usd leaves after extraction; a reused record it stops keeps the score it had,
    with that score's digest, so the next run judges it. Returns (its cost, records a budget
    left unjudged)."""
    from conductor.enrich.judge import judge

    gold = [df.get_column(r.column).to_list() for r in job.references.values()]
    items = []
    answer = "record" if job.fields else "text"  # a plain-text job's reply is judged as it is
    for i in todo:
        c = computed.get(ids[i])
        if c and c["status"] == OK and all(g[i] is None for g in gold):
            items.append((ids[i], prompts[i], c[answer]))
    for i in reuse:
        p = previous.get(ids[i])
        if p and p["status"] == OK and p.get("judge_hash") != current and all(g[i] is None for g in gold):
            items.append((ids[i], prompts[i], p[answer]))
    if not items:
        return 0.0, 0
    budget = None
    if job.budget_usd is not None:
        spent = pq.read_table(run.table("results"), columns=["cost_usd"]).column(0) if todo else None
        # extraction's calls never answered may be billed too: at their worst case, as its budget counted them
        lost = lost_in_flight(run.read_manifest())["reserved_usd"] if todo else 0.0
        budget = max(0.0, job.budget_usd - ((pc.sum(spent).as_py() or 0.0) if spent is not None else 0.0) - lost)
    scores, cost, stopped = judge(job, run, data_dir, items, progress, budget, refresh)
    for rid, (score, reason, answered) in scores.items():  # a record the budget stopped is not in scores
        if answered:
            target = computed.get(rid) or previous[rid]
            target["judge_score"], target["judge_reason"], target["judge_hash"] = score, reason, current
        elif rid in computed:  # the call failed: no digest, so the next run asks again
            computed[rid]["judge_score"], computed[rid]["judge_reason"] = None, reason
        # a reused record whose call failed keeps the score it had, with its own digest
    return cost, stopped


def _outcomes(job: Job, pool: Pool, run: RunDir):
    """Per id: the chosen plan's record (sample 0 unless another sample is valid and it is
    not), status, error, cost and calls over all samples, and per-field confidence."""
    checker = RecordChecker(job.check_schema) if job.fields else None
    results = pq.read_table(run.table("results"), columns=[
        "plan_id", "query_id", "sample", "status", "final_answer", "error", "cost_usd", "calls"]).to_pylist()
    steps = _record_steps(pool, run) if job.fields else {}
    out: dict[str, dict[str, Any]] = {}
    plans: list[dict[str, Any]] = []
    for r in results:
        rec, status, error = None, r["status"], r["error"]
        if status == "ok":
            if checker is None:
                status = OK
            else:
                rec, why = checker.check(r["final_answer"])
                status, error = (OK, None) if why is None else ("invalid", f"final output: {why}")
        elif status == "error" and error and "not a valid record" in error:
            status = "invalid"
        elif status == "invalid_plan":
            status = "invalid_plan"
        row = {"record": rec, "text": r["final_answer"] if checker is None else None, "status": status,
               "error": error, "cost_usd": r["cost_usd"], "calls": r["calls"] or 0, "plan_id": r["plan_id"],
               "sample": r["sample"], "confidence": _confidence(job, rec, steps.get(r["plan_id"], []))}
        plans.append({**row, "query_id": r["query_id"]})
        best = out.get(r["query_id"])
        if best is None:
            out[r["query_id"]] = dict(row)
        else:
            cost = None if best["cost_usd"] is None or row["cost_usd"] is None else best["cost_usd"] + row["cost_usd"]
            keep = row if best["status"] != OK and row["status"] == OK else best
            out[r["query_id"]] = {**keep, "cost_usd": cost, "calls": best["calls"] + row["calls"]}
    return out, plans


def _record_steps(pool: Pool, run: RunDir) -> dict[str, list[dict[str, Any]]]:
    """Per plan, the records its top-level llm steps answered (repairs included), leaving out
    the step whose output is the plan's answer: the others are the witnesses of its values."""
    traces = pq.read_table(run.table("traces"), columns=[
        "plan_id", "step_path", "worker", "status", "response_text"]).to_pylist()
    llm = {w.id for w in pool.workers if w.kind == "llm"}
    per: dict[str, dict[int, Any]] = {}
    last: dict[str, tuple[int, str]] = {}  # plan -> (index, worker) of the last step that ran
    for t in traces:
        path = t["step_path"].removesuffix(".repair")
        if t["status"] != "ok" or not path.isdigit():
            continue
        i = int(path)
        if i >= last.get(t["plan_id"], (-1, ""))[0]:
            last[t["plan_id"]] = (i, t["worker"])
        if t["worker"] in llm:
            obj, err = parse_reply(t["response_text"])
            if err is None:
                per.setdefault(t["plan_id"], {})[i] = obj
    out = {}
    for pid, steps in per.items():
        final, worker = last[pid]
        out[pid] = [r for i, r in sorted(steps.items()) if not (i == final and worker in llm)]
    return out


def _confidence(job: Job, rec: dict | None, step_records: list[dict[str, Any]]) -> dict[str, float] | None:
    """Per field, the share of the plan's other record steps (extractors a reconciler or a
    vote saw) that gave the final value; None when the answer came from the only one."""
    if rec is None or not step_records:
        return None
    out = {}
    for f in job.fields:
        final = orjson.dumps(rec.get(f.name), option=orjson.OPT_SORT_KEYS)
        same = sum(orjson.dumps(s.get(f.name), option=orjson.OPT_SORT_KEYS) == final for s in step_records)
        out[f.name] = same / len(step_records)
    return out


# ---- records ----------------------------------------------------------------

def _row_outcomes(ids: list[str], computed: dict, previous: dict, reused: set[int],
                  run_id: str) -> list[dict[str, Any]]:
    """Per input row: its reused or computed outcome."""
    rows: list[dict[str, Any]] = []
    for i, rid in enumerate(ids):
        if i in reused:
            p = previous[rid]
            rows.append({"record": p["record"], "text": p.get("text"), "status": p["status"], "error": p["error"],
                         "cost_usd": 0.0, "calls": 0, "confidence": p["confidence"], "run_id": p["run_id"],
                         "reused": True, "judge_score": p.get("judge_score"), "judge_reason": p.get("judge_reason"),
                         "judge_hash": p.get("judge_hash")})
        else:
            c = computed.get(rid) or {"record": None, "text": None, "status": "error", "confidence": None,
                                      "error": "no outcome recorded", "cost_usd": None, "calls": 0}
            rows.append({**c, "run_id": run_id, "reused": False})
    return rows


def _records_table(job: Job, df: pl.DataFrame, ids: list[str], hashes: list[str], rows: list[dict[str, Any]],
                   records: list[dict[str, Any] | None], now: datetime) -> pa.Table:
    n = len(ids)
    # The id keeps its input type, so the view joins to the input table without a cast.
    cols: dict[str, pa.Array] = {job.id_column: _plain(df.select(job.id_column).to_arrow().column(0))}
    if job.carry:
        carried = df.select(list(job.carry)).to_arrow()
        for name in job.carry:
            cols[name] = _plain(carried.column(name))
    if job.fields:
        cols.update(typed_columns(job.fields, records))
        for f in job.fields:
            cols[f"{f.name}_confidence"] = pa.array(
                [(r["confidence"] or {}).get(f.name) for r in rows], pa.float64())
    else:
        cols["text"] = pa.array([r.get("text") for r in rows], pa.string())
    if job.references:
        scores = row_scores(job, df, records)
        cols["score"] = pa.array(scores, pa.float64())
    if job.quality.get("judge"):
        cols["judge_score"] = pa.array([r.get("judge_score") for r in rows], pa.float64())
        cols["judge_reason"] = pa.array([r.get("judge_reason") for r in rows], pa.string())
        cols["judge_hash"] = pa.array([r.get("judge_hash") for r in rows], pa.string())
    cols.update({
        "status": pa.array([r["status"] for r in rows], pa.string()),
        "error": pa.array([r["error"] for r in rows], pa.string()),
        "cost_usd": pa.array([r["cost_usd"] for r in rows], pa.float64()),
        "calls": pa.array([r["calls"] for r in rows], pa.int32()),
        "run_id": pa.array([r["run_id"] for r in rows], pa.string()),
        "reused": pa.array([r["reused"] for r in rows], pa.bool_()),
        "row_hash": pa.array(hashes, pa.string()),
        "updated_at": pa.array([now] * n, TS),
    })
    return pa.table(cols)


def _plain(arr: pa.ChunkedArray) -> pa.ChunkedArray:
    """polars writes large/view strings; the catalog and joins want plain utf8."""
    t = arr.type
    if pa.types.is_large_string(t) or str(t) == "string_view":
        return arr.cast(pa.string())
    return arr


def _write_rewards(job: Job, df: pl.DataFrame, ids: list[str], run: RunDir, plans: list[dict[str, Any]]) -> None:
    """rewards.parquet for the plans this run executed: the row's score against its references
    (0 for a plan without a valid record), so enrichment rows serve the policy and RL export too."""
    index = {rid: i for i, rid in enumerate(ids)}
    sub = df[[index[p["query_id"]] for p in plans]] if plans else df.clear()
    scores = row_scores(job, sub, [p["record"] for p in plans]) if job.references else [None] * len(plans)
    refs = references(job, sub)
    rows = []
    for p, score, ref in zip(plans, scores, refs):
        if p["status"] == "budget_exhausted":
            score = None  # not finished: a rerun finishes it
        rows.append({"run_id": run.run_id, "plan_id": p["plan_id"], "query_id": p["query_id"],
                     "query_index": index[p["query_id"]], "sample": p["sample"], "task": "record",
                     "status": p["status"], "reference": ref,
                     "answer": orjson.dumps(p["record"]).decode() if p["record"] is not None else p.get("text"),
                     "parsed": p["status"] == OK, "correct": None if score is None else score == 1.0,
                     "reward": score, "advantage": None, "cost_usd": p["cost_usd"]})
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["query_id"], []).append(r)
    for g in groups.values():
        for r, a in zip(g, group_advantages([r["reward"] for r in g])):
            r["advantage"] = a
    write_table(run.table("rewards"), rows_to_table(rows, schemas.REWARDS))


# ---- summary ----------------------------------------------------------------

def _summary(job: Job, table: pa.Table, run: RunDir, todo: int, reused: int, wall: float,
             metrics: dict[str, Any]) -> dict[str, Any]:
    """`computed`: the rows this run computed, not those of its `todo` that a budget stopped
    (`statuses.budget_exhausted`, only ever rows to compute): counted as computed, SQL over
    summary->>'computed' overstated the work of a stopped run."""
    statuses = {d["values"]: d["counts"] for d in pc.value_counts(table.column("status")).to_pylist()}
    computed = todo - statuses.get("budget_exhausted", 0)
    cost = pc.sum(table.column("cost_usd")).as_py() or 0.0
    return {
        "job": job.name, "run_id": run.run_id, "id_column": job.id_column,
        "fields": [f.name for f in job.fields] or ["text"], "rows": table.num_rows, "computed": computed, "reused": reused,
        "valid": statuses.get(OK, 0), "failed": table.num_rows - statuses.get(OK, 0),
        "statuses": statuses, "cost_usd": cost,
        "unpriced_rows": pc.sum(pc.is_null(table.column("cost_usd"))).as_py() or 0,
        "calls": pc.sum(table.column("calls")).as_py() or 0,
        "records_path": str(run.table("records")), "metrics": metrics,
        "wall_time_s": round(wall, 3),
    }


def exit_code(job: Job, summary: dict[str, Any]) -> int:
    """`conductor job run`'s exit status, kept in the summary so that the catalog's `runs` view
    tells a job run below its quality gate from a good one: 3 when a budget stopped rows or
    left records unjudged, 4 below quality.min_valid_share, else 0."""
    if summary["statuses"].get("budget_exhausted") or summary.get("judge_budget_exhausted"):
        return 3
    return 4 if summary["metrics"]["valid_share"] < job.quality["min_valid_share"] else 0


# What varies within one cause: dollar amounts, and the position a JSON parser names in a reply
# (`unexpected end of data: line 1 column 46 (char 45)`): replies cut off at 121 lengths showed as
# 121 causes, the largest of all hidden under "... and N more" (audit75 F1).
_VARYING = re.compile(r"\$[0-9][0-9,]*(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?|line [0-9]+ column [0-9]+ \(char [0-9]+\)")


def record_failure_groups(table: pa.Table, show: int = 5) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Rows without a valid record, one group per status and cause, the largest `show` of them,
    and what is left out ({"rows", "groups"}). Dollar amounts and JSON parse positions are not part
    of the cause: a budget stop names the spend so far and the call's worst case, which vary row by
    row, and split one cause into hundreds of groups of which five were shown with no word of the
    rest (audit66 F3). A group's values that vary are shown as their range. Each record keeps its
    full error."""
    groups: dict[tuple[str, str], list[list[str]]] = {}
    for status, error in zip(table.column("status").to_pylist(), table.column("error").to_pylist()):
        if status != OK:
            error = error or ""
            groups.setdefault((status, _VARYING.sub("\0", error)), []).append(_VARYING.findall(error))
    top = sorted(groups.items(), key=lambda kv: -len(kv[1]))
    shown = [{"status": st, "error": _short(_with_values(cause, values)), "rows": len(values)}
             for (st, cause), values in top[:show]]
    rest = top[show:]
    return shown, {"rows": sum(len(a) for _, a in rest), "groups": len(rest)}


def _with_values(cause: str, values: list[list[str]]) -> str:
    """The cause with each of its varying values put back: as written when every row has the
    same, else as the group's range (`$0.0013 to $0.0016`, `line 1 column 14 (char 13) to line 1
    column 148 (char 147)`)."""
    parts = cause.split("\0")  # where the values were
    out = [parts[0]]
    for k, tail in enumerate(parts[1:]):
        seen = sorted({v[k] for v in values}, key=_magnitude)
        out.append(seen[0] if len(seen) == 1 else f"{seen[0]} to {seen[-1]}")
        out.append(tail)
    return "".join(out)


def _magnitude(value: str) -> float:
    """An amount's dollars, a parse position's character offset: what its range is ordered by."""
    if value.startswith("$"):
        return float(value[1:].replace(",", ""))
    return float(value[value.rindex("char ") + 5:-1])


def _short(error: str, head: int = 160, tail: int = 100) -> str:
    """A long error cut in its middle, marked: its end is the advice (what to check, when to
    retry), which a cut at 160 characters dropped without a sign ("no line of it ran: che")."""
    return error if len(error) <= head + tail + 5 else f"{error[:head]} ... {error[-tail:]}"
