"""Plans answered entirely from the caches, served in bulk before any task starts.

A rerun of a finished job finds every call cached. Served like a call (a task
per plan and per step, one query per cache per step) that cost about 0.3 ms a
step, most of a rerun's wall. Here a batch of plans is resolved in waves: the
keys of every ready step of every plan in one query per cache, then the steps
those answers unblock. A plan with every step a hit gets the same rows, in the
same order, as the call path writes (`Executor._cached_row` / `_claim_row`,
`_finish_plan`); any other plan (a miss, a condition, a function or planner
step, a record schema, restored steps) is handed back to run as usual.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from conductor.context import step_messages
from conductor.execute.cache import Entry

if TYPE_CHECKING:
    from conductor.execute.engine import Executor, PlanJob


def serve_cached(ex: "Executor", jobs: list["PlanJob"], restored: dict[str, Any]) -> list["PlanJob"]:
    """Write the step and plan rows of every plan in `jobs` whose steps are all
    cache hits; return the other jobs, in order, for the call path (with those
    whose plan ids are in `restored`: a resumed plan's finished steps are kept)."""
    if ex.run_cache is None and (ex.cache is None or ex.opt.refresh):
        return jobs
    t0 = time.time()
    found: dict[int, dict[int, tuple[str, Entry, bool]]] = {}  # job -> step -> (key, entry, from run cache)
    live = [n for n, job in enumerate(jobs) if job.plan_id not in restored and _servable(ex, job)]
    for n in live:
        found[n] = {}
    while live:
        asks: list[tuple[int, int, str]] = []  # (job, step, key) of every step whose inputs are known
        for n in live:
            steps, got = jobs[n].plan.steps, found[n]  # type: ignore[union-attr]
            outputs = {i: hit[1].text for i, hit in got.items()} if got else {}
            for i, step in enumerate(steps):
                if i in got or (step.access and not all(j in got for j in step.access)):  # no conditions here
                    continue
                worker = ex.pool.worker(step.worker)
                asks.append((n, i, ex.request_key(worker, step_messages(step, steps, outputs, worker.system))[1]))
        keys = [a[2] for a in asks]
        own = ex.run_cache.get_many(keys) if ex.run_cache is not None else {}
        rest = [k for k in keys if k not in own]
        shared = ex.cache.get_many(rest) if rest and ex.cache is not None and not ex.opt.refresh else {}
        missed = set()
        for n, i, key in asks:
            if key in own:
                found[n][i] = (key, own[key], True)
            elif key in shared:
                found[n][i] = (key, shared[key], False)
            else:
                missed.add(n)
        live = [n for n in live if n not in missed and len(found[n]) < len(jobs[n].plan.steps)]  # type: ignore[union-attr]
    rest_jobs: list["PlanJob"] = []
    step_rows: list[dict[str, Any]] = []
    plan_rows: list[dict[str, Any]] = []
    t1 = time.time()  # the batch's steps and plans all end now
    try:
        for n, job in enumerate(jobs):
            got = found.get(n)
            if got is None or len(got) < len(job.plan.steps):  # type: ignore[union-attr]
                rest_jobs.append(job)
            else:
                _plan_rows(ex, job, got, t0, t1, step_rows, plan_rows)
    finally:  # the rows of plans counted so far, whatever happens next: steps before their plans
        if step_rows:
            ex._durably(ex.journal.steps, step_rows)
        if plan_rows:
            ex._durably(ex.journal.plans, plan_rows)
    return rest_jobs


def _servable(ex: "Executor", job: "PlanJob") -> bool:
    """Whether the plan's steps are all plain calls (no condition, function, planner or record)."""
    if job.plan is None or job.record is not None or ex._abort is not None:
        return False
    for step in job.plan.steps:
        if step.when is not None or not ex.pool.has(step.worker) or ex.pool.worker(step.worker).kind != "llm":
            return False
    return True


def _plan_rows(ex: "Executor", job: "PlanJob", got: dict[int, tuple[str, Entry, bool]], t0: float, t1: float,
               step_rows: list[dict[str, Any]], plan_rows: list[dict[str, Any]]) -> None:
    """The rows the call path writes for this plan, added to the batch's lists."""
    rows: list[dict[str, Any]] = []
    for i, step in enumerate(job.plan.steps):  # type: ignore[union-attr]
        key, entry, own = got[i]
        worker = ex.pool.worker(step.worker)
        if own and key not in ex._paid:  # paid by a process killed before it logged the call
            rows.append(ex._claim_row(job, str(i), 0, step, worker, key, entry, t0, ended=t1, out=step_rows))
        else:
            rows.append(ex._cached_row(job, str(i), 0, step, worker, key, entry, t0, ended=t1, out=step_rows))
    ex._sub_plans.pop(job.plan_id, None)
    # every step ran and none has a condition: the last one answers (engine.plan_outcome)
    ex._finish_plan(job, "ok", rows[-1]["response_text"], None, rows, t0, ended=t1, out=plan_rows)
