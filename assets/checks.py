"""Asset checks on a run's outputs.

Blocking (a failure stops the assets downstream in the same run, because a bad
output must not flow on):
- plans: the share of valid plans is at least `checks.min_valid_share` (else
  executing would pay for a run that mostly fails), and plan ids are unique;
- executions: every plan has a result or an explicit status, and ids are unique
  (grading a run with missing or doubled plans reports a wrong accuracy); the
  share of failed plans is at most the threshold (a provider that was down must
  not be graded as a model that answered wrong; re-materializing retries them);
- rewards: plan ids are unique.
- executions: no plan was stopped by a budget. The run is unfinished (the CLI
  exits 3), and an unattended job must not publish rewards and an accuracy
  over the plans that happened to fit as if they were the run; a rerun with a
  higher budget finishes it without paying twice, and materializing `rewards`
  and `run_report` alone grades the run as it stands.
Not blocking, severity ERROR: spend <= budget. The money is spent by then; the
report must still be written so that the overspend is visible.

The checks are partitioned like their assets: each evaluates one query set's
run, and the UI shows their result per partition. Each is a plain function of
the run's files (`evaluate_*`), wrapped as a Dagster check; the tests call both.
"""

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from dagster import AssetCheckResult, AssetCheckSeverity, MetadataValue, asset_check

from conductor import runner
from conductor.errors import ConductorError
from conductor.failures import (ENV_MAX_FAILED_SHARE, failed_plans, failure_groups, max_failed_share, rerun_advice,
                                retried_by_rerun, where_it_ran)
from conductor.pool import load_pool
from conductor.report import markdown_table
from conductor.stats import run_totals
from conductor.store import RunDir
from assets.partitions import query_sets
from assets.resources import ChecksResource

_SHOW = 5


def _run_dir(cfg: runner.RunConfig) -> RunDir:
    return RunDir(cfg.data_dir, cfg.run_id)


def _listing(values: list) -> str:
    return ", ".join(map(str, values[:_SHOW])) + (f" and {len(values) - _SHOW} more" if len(values) > _SHOW else "")


def evaluate_valid_share(plans_path: Path, threshold: float) -> AssetCheckResult:
    t = pq.read_table(plans_path, columns=["plan_id", "valid", "error"])
    n = t.num_rows
    valid = pc.sum(t.column("valid").cast("int64")).as_py() or 0
    share = valid / n if n else 0.0
    invalid = pc.filter(t, pc.invert(t.column("valid"))).slice(0, _SHOW).to_pylist()
    return AssetCheckResult(
        passed=n > 0 and share >= threshold,
        description=f"{valid} of {n} plans valid ({share:.1%}); threshold {threshold:.1%}",
        metadata={"valid_share": share, "threshold": threshold, "plans": n, "invalid": n - valid,
                  "invalid_examples": MetadataValue.md(markdown_table(invalid, ["plan_id", "error"]))})


def evaluate_unique_ids(path: Path, columns: list[str]) -> AssetCheckResult:
    t = pq.read_table(path, columns=columns)
    keys = t.column(columns[0]) if len(columns) == 1 else pc.binary_join_element_wise(
        *[pc.cast(t.column(c), pa.string()) for c in columns], "|")
    nulls = pc.sum(pc.is_null(keys)).as_py() or 0
    counts = pc.value_counts(keys.drop_null())
    dups = pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1)).to_pylist()
    what = " + ".join(columns)
    problems = []
    if dups:
        problems.append(f"{len(dups)} duplicate {what}: {_listing(dups)}")
    if nulls:
        problems.append(f"{nulls} row(s) without {what}")
    return AssetCheckResult(
        passed=not problems,
        description="; ".join(problems) or f"{t.num_rows} rows, every {what} unique",
        metadata={"rows": t.num_rows, "duplicates": len(dups), "null_ids": nulls,
                  "file": MetadataValue.path(str(path))})


def evaluate_results_complete(plans_path: Path, results_path: Path) -> AssetCheckResult:
    """Every plan has a result row with an answer or an explicit failure
    status ('ok' without an answer counts as neither)."""
    plan_ids = pq.read_table(plans_path, columns=["plan_id"]).column("plan_id")
    r = pq.read_table(results_path, columns=["plan_id", "status", "final_answer"])
    missing = pc.filter(plan_ids, pc.invert(pc.is_in(plan_ids, value_set=r.column("plan_id").combine_chunks())))
    extra = pc.filter(r.column("plan_id"), pc.invert(pc.is_in(r.column("plan_id"), value_set=plan_ids.combine_chunks())))
    status = r.column("status")
    no_status = pc.fill_null(pc.or_(pc.equal(pc.utf8_length(status), 0),
                                    pc.and_(pc.equal(status, "ok"), pc.is_null(r.column("final_answer")))), True)
    no_status_ids = pc.filter(r.column("plan_id"), no_status)
    problems = []
    if len(missing):
        problems.append(f"{len(missing)} plan(s) without a result: {_listing(missing.to_pylist())}")
    if len(extra):
        problems.append(f"{len(extra)} result(s) for unknown plans: {_listing(extra.to_pylist())}")
    if len(no_status_ids):
        problems.append(f"{len(no_status_ids)} result(s) with neither an answer nor a failure status: "
                        f"{_listing(no_status_ids.to_pylist())}")
    statuses = {str(d["values"]): d["counts"] for d in pc.value_counts(status).to_pylist()}
    return AssetCheckResult(
        passed=not problems,
        description="; ".join(problems) or f"all {len(plan_ids)} plans have a result or an explicit status",
        metadata={"plans": len(plan_ids), "missing": len(missing), "without_status": len(no_status_ids),
                  "statuses": MetadataValue.json(statuses)})


def _rematerialize(group: dict, retried: bool = False) -> str:
    """The CLI's rerun advice in Dagster's words: retry_failed is query_set's run config setting.
    `retried`: the run had retry_failed: true, so a final group failed again under it."""
    redo = ("they failed again under retry_failed: true: fix the cause first" if retried
            else "rematerialize with retry_failed: true")
    return rerun_advice(group, rerun="rematerialization", redo=redo, flag="retry_failed: true")


def _needs_retry_failed(group: dict) -> bool:
    """A failure only retry_failed: true sends again: final, or out of transient retries."""
    return not (retried_by_rerun(group) or group.get("journal_deleted") or group["failure"] == "budget")


def _next_step(groups: list[dict]) -> str:
    """What finishes a failed check. "Materialize again to retry" only when that retries something:
    with every group final it contradicted the groups' own advice, and the run failed the same way."""
    if any(retried_by_rerun(g) for g in groups):
        step = "materialize the partition again to retry"
    elif any(_needs_retry_failed(g) for g in groups):
        step = ("materializing the partition again as it is retries none of these: fix the cause, then "
                "rematerialize with retry_failed: true")
    else:
        return ""
    return f"; {step} (Re-execute from failure reruns only this check, which reads the same results)"


def failed_share_threshold() -> float:
    """$CONDUCTOR_MAX_FAILED_SHARE, or an error naming it. The assets that call
    providers read it first, so that a bad value fails before money is spent."""
    try:
        return max_failed_share()
    except ConductorError:
        raise ConductorError(f"{ENV_MAX_FAILED_SHARE}={os.environ.get(ENV_MAX_FAILED_SHARE)!r}: expected a share "
                             f"of failed plans between 0 and 1, e.g. 0.05") from None


def evaluate_failed_share(run: RunDir, pool_path: Path, threshold: float, retried: bool = False) -> AssetCheckResult:
    """Failed plans (every status but ok and budget_exhausted) against the threshold,
    with the failures grouped by worker and kind, and the URL each worker calls.
    `retried`: the run had retry_failed: true (its final failures failed again under it)."""
    status = pq.read_table(run.table("results"), columns=["status"]).column("status")
    statuses = {str(d["values"]): d["counts"] for d in pc.value_counts(status).to_pylist()}
    failed, total = failed_plans(statuses)
    share = failed / total if total else 0.0
    groups = failure_groups(run.table("traces"), load_pool(pool_path))
    desc = f"{failed} of {total} plans failed ({share:.1%}); threshold {threshold:.1%}"
    if groups:
        desc += "; " + "; ".join(f"worker {g['worker']} {where_it_ran(g)}: {g['failure']} x{g['plans']}: "
                                 f"{_rematerialize(g, retried)}"
                                 for g in groups[:_SHOW])
    passed = total > 0 and share <= threshold
    if not passed:
        desc += _next_step(groups)
    return AssetCheckResult(
        passed=passed, description=desc,
        metadata={"failed_share": share, "threshold": threshold, "failed_plans": failed,
                  "failures": MetadataValue.md(markdown_table(groups, ["worker", "url", "failure", "plans",
                                                                      "retried_on_rerun", "example"])
                                               if groups else "_none_")})


def evaluate_budget_stop(results_path: Path) -> AssetCheckResult:
    """Plans a budget stopped (budget_exhausted): the run is unfinished, as the CLI's exit 3 says."""
    status = pq.read_table(results_path, columns=["status"]).column("status")
    stopped = pc.sum(pc.fill_null(pc.equal(status, "budget_exhausted"), False).cast("int64")).as_py() or 0
    desc = (f"{stopped} of {len(status)} plans stopped by a budget (budget_exhausted); to finish them, raise the "
            f"run's budget_usd (query_set run config) or the provider's budget_usd in the pool file and "
            f"rematerialize the partition: finished plans are not paid again; to grade the run as it stands, "
            f"materialize rewards and run_report alone" if stopped
            else f"no plan of {len(status)} stopped by a budget")
    return AssetCheckResult(passed=not stopped, description=desc,
                            metadata={"budget_exhausted": stopped, "plans": len(status)})


def evaluate_spend(run: RunDir, pool_path: Path, run_budget: float | None,
                   max_run_usd: float | None) -> AssetCheckResult:
    """Spend against every cap that applies: the run's budget, the checks'
    max_run_usd, and each provider's budget_usd in the pool file (per run, as
    conductor enforces it)."""
    traces = pq.read_table(run.table("traces"), columns=["provider", "cost_usd"])
    totals = run_totals(run.path)
    spent, unpriced = totals.cost_usd, totals.plans_without_price
    by_provider = {r["provider"]: r["cost_usd_sum"] or 0.0
                   for r in traces.group_by("provider").aggregate([("cost_usd", "sum")]).to_pylist()}
    caps = [("run budget_usd", run_budget, spent), ("checks max_run_usd", max_run_usd, spent)]
    pool = load_pool(pool_path)
    caps += [(f"provider {pid} budget_usd", p.budget_usd, by_provider.get(pid, 0.0))
             for pid, p in sorted(pool.providers.items())]
    rows = [{"cap": name, "limit_usd": limit, "spent_usd": used, "ok": used <= limit + 1e-9}
            for name, limit, used in caps if limit is not None]
    over = [r for r in rows if not r["ok"]]
    desc = ("over budget: " + "; ".join(f"{r['cap']} ${r['spent_usd']:.4f} > ${r['limit_usd']:.4f}" for r in over)
            if over else f"spent ${spent:.4f}; within " + (", ".join(r["cap"] for r in rows) or "no budget set"))
    if unpriced:
        desc += f"; {unpriced} plan(s) with calls of unknown price: those calls are not counted"
    return AssetCheckResult(
        passed=not over, severity=AssetCheckSeverity.ERROR, description=desc,
        metadata={"spent_usd": spent, "caps": MetadataValue.md(markdown_table(rows) if rows else "_no budget set_"),
                  "unpriced_plans": unpriced, "by_provider_usd": MetadataValue.json(by_provider)})


# ---- the Dagster checks -------------------------------------------------------

@asset_check(partitions_def=query_sets, asset="plans", name="valid_plan_share", blocking=True,
             description="Share of valid plans >= checks.min_valid_share; blocks executing a mostly broken plan set.")
def plans_valid_share(plans: runner.RunConfig, checks: ChecksResource) -> AssetCheckResult:
    return evaluate_valid_share(_run_dir(plans).table("plans"), checks.min_valid_share)


@asset_check(partitions_def=query_sets, asset="plans", name="unique_ids", blocking=True,
             description="plan_id is unique and never null.")
def plans_unique_ids(plans: runner.RunConfig) -> AssetCheckResult:
    return evaluate_unique_ids(_run_dir(plans).table("plans"), ["plan_id"])


@asset_check(partitions_def=query_sets, asset="executions", name="every_plan_has_result", blocking=True,
             description="Every plan has one result with an answer or an explicit failure status.")
def executions_complete(executions: runner.RunConfig) -> AssetCheckResult:
    run = _run_dir(executions)
    return evaluate_results_complete(run.table("plans"), run.table("results"))


@asset_check(partitions_def=query_sets, asset="executions", name="unique_ids", blocking=True,
             description="plan_id is unique in results, and plan_id + step_path in traces.")
def executions_unique_ids(executions: runner.RunConfig) -> AssetCheckResult:
    run = _run_dir(executions)
    results = evaluate_unique_ids(run.table("results"), ["plan_id"])
    if not results.passed:
        return results
    return evaluate_unique_ids(run.table("traces"), ["plan_id", "step_path"])


@asset_check(partitions_def=query_sets, asset="executions", name="failed_share", blocking=True,
             description="Share of failed plans <= $CONDUCTOR_MAX_FAILED_SHARE (default 5%); blocks grading a run "
                         "whose provider was down. Re-materializing retries transient failures; with the "
                         "query_set config retry_failed: true, every failure.")
def executions_failed_share(executions: runner.RunConfig) -> AssetCheckResult:
    run = _run_dir(executions)
    return evaluate_failed_share(run, Path(executions.pool), failed_share_threshold(), executions.retry_failed)


@asset_check(partitions_def=query_sets, asset="executions", name="no_budget_stop", blocking=True,
             description="No plan stopped by a budget (budget_exhausted); blocks grading an unfinished run: raise "
                         "the budget and rematerialize, or materialize rewards and run_report alone.")
def executions_budget_stop(executions: runner.RunConfig) -> AssetCheckResult:
    return evaluate_budget_stop(_run_dir(executions).table("results"))


@asset_check(partitions_def=query_sets, asset="executions", name="spend_within_budget", blocking=False,
             description="Spend <= the run budget, checks.max_run_usd and each provider's budget_usd.")
def executions_spend(executions: runner.RunConfig, checks: ChecksResource) -> AssetCheckResult:
    return evaluate_spend(_run_dir(executions), Path(executions.pool), executions.budget_usd, checks.max_run_usd)


@asset_check(partitions_def=query_sets, asset="rewards", name="unique_ids", blocking=True,
             description="plan_id is unique and never null.")
def rewards_unique_ids(rewards: runner.RunConfig) -> AssetCheckResult:
    return evaluate_unique_ids(_run_dir(rewards).table("rewards"), ["plan_id"])


ALL = [plans_valid_share, plans_unique_ids, executions_complete, executions_unique_ids, executions_failed_share,
       executions_budget_stop, executions_spend, rewards_unique_ids]
