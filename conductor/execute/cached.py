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
    from conductor.plans import Step


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
    rows = _Rows(ex, t0, time.time())  # the batch's steps and plans all end now
    try:
        for n, job in enumerate(jobs):
            got = found.get(n)
            if got is None or len(got) < len(job.plan.steps):  # type: ignore[union-attr]
                rest_jobs.append(job)
            else:
                rows.plan(job, got)
    finally:  # the rows of plans counted so far, whatever happens next: steps before their plans
        if rows.steps:
            ex._durably(ex.journal.steps, rows.steps)
        if rows.plans:
            ex._durably(ex.journal.plans, rows.plans)
    return rest_jobs


def _servable(ex: "Executor", job: "PlanJob") -> bool:
    """Whether the plan's steps are all plain calls (no condition, function, planner or record)."""
    if job.plan is None or job.record is not None or job.refresh or ex._abort is not None:
        return False
    for step in job.plan.steps:
        if step.when is not None or not ex.pool.has(step.worker) or ex.pool.worker(step.worker).kind != "llm":
            return False
    return True


class _Rows:
    """The rows the call path writes for the batch's plans (`Executor._cached_row`,
    `_claim_row`, `_finish_plan`). Rows of cache hits differ from the batch's first
    of their kind only in a few fields, so later ones are that row's copy with those
    fields set: cheaper than building each anew, and a rerun writes one per step."""

    def __init__(self, ex: "Executor", t0: float, t1: float):
        self.ex, self.t0, self.t1 = ex, t0, t1
        self.steps: list[dict[str, Any]] = []
        self.plans: list[dict[str, Any]] = []
        self._step_base: dict[str, dict[str, Any]] = {}  # worker -> its first hit row
        self._plan_base: dict[str, Any] | None = None  # the first row of a plan of hits only

    def plan(self, job: "PlanJob", got: dict[int, tuple[str, Entry, bool]]) -> None:
        ex, rows, claimed = self.ex, [], False
        for i, step in enumerate(job.plan.steps):  # type: ignore[union-attr]
            key, entry, own = got[i]
            worker = ex.pool.worker(step.worker)
            if own and key not in ex._paid:  # paid by a process killed before it logged the call
                claimed = True
                rows.append(ex._claim_row(job, str(i), 0, step, worker, key, entry, self.t0, ended=self.t1,
                                          out=self.steps))
            elif (base := self._step_base.get(worker.id)) is None:
                rows.append(row := ex._cached_row(job, str(i), 0, step, worker, key, entry, self.t0, ended=self.t1,
                                                  out=self.steps))
                self._step_base[worker.id] = row
            else:
                rows.append(self._hit(base, job, i, step, key, entry))
        ex._sub_plans.pop(job.plan_id, None)
        # every step ran and none has a condition: the last one answers (engine.plan_outcome)
        answer = rows[-1]["response_text"]
        if claimed or self._plan_base is None:
            ex._finish_plan(job, "ok", answer, None, rows, self.t0, ended=self.t1, out=self.plans)
            if not claimed:
                self._plan_base = self.plans[-1]
            return
        row = self._plan_base.copy()
        row["plan_id"], row["query_id"], row["query_index"], row["sample"] = (
            job.plan_id, job.query_id, job.query_index, job.sample)
        row["final_answer"], row["calls"], row["cache_hits"] = answer, 0, len(rows)
        self.plans.append(row)
        ex.progress.c.plans_done += 1
        ex.progress.tick()

    def _hit(self, base: dict[str, Any], job: "PlanJob", i: int, step: "Step", key: str,
             entry: Entry) -> dict[str, Any]:
        self.ex.progress.c.cache_hits += 1
        row = base.copy()
        row["plan_id"], row["query_id"], row["query_index"], row["sample"] = (
            job.plan_id, job.query_id, job.query_index, job.sample)
        row["step"], row["step_path"], row["instruction"], row["request_key"] = i, str(i), step.instruction, key
        row["prompt_tokens"], row["completion_tokens"], row["usage_estimated"] = (
            entry.prompt_tokens, entry.completion_tokens, entry.usage_estimated)
        row["original_cost_usd"], row["latency_s"] = entry.cost_usd, round(entry.latency_s, 6)
        row["response_text"], row["simulated"] = entry.text, entry.simulated
        row["input_price"], row["output_price"], row["paid_mode"] = (
            entry.input_price, entry.output_price, entry.paid_mode)
        self.steps.append(row)
        return row
