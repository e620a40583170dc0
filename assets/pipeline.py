"""The run as Dagster assets, one partition per query-set file:
query_set -> plans -> executions -> rewards -> run_report, then worker_stats
over every run (the daily enrichment).

Each asset calls one stage of `conductor.runner` and attaches what a person
checking the run wants to see. The value passed between assets is the run's
configuration; the data itself lives in the run's Parquet files. The run id is
derived from the inputs, so rematerializing a partition (a rerun, a retry, a
backfill) resumes the same run instead of paying for it twice.
"""

from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from dagster import (
    AssetExecutionContext,
    Backoff,
    Config,
    DagsterExecutionInterruptedError,
    Failure,
    Jitter,
    MaterializeResult,
    MetadataValue,
    Output,
    RetryPolicy,
    asset,
)
from pydantic import Field

from conductor import runner, stats
from conductor.errors import ConductorError
from conductor.execute.shared.url import GovernorDown
from conductor.progress import Progress
from conductor.report import summary_markdown
from conductor.store import refresh_catalog, write_table
from assets.charts import accuracy_cost_chart
from assets.checks import failed_share_threshold
from assets.concurrency import POOLS_TAG, hold_pools, planner_pools, provider_pools
from assets.metadata import png_markdown, rows_metadata, table_metadata
from assets.partitions import query_sets
from assets.resources import (EnrichResource, PlannerResource, PoolResource, QueryFilesResource,
                              StorageResource)

GROUP = "conductor"


class RunSettings(Config):
    samples: int = Field(default=1, description="plans per query")
    seed: int = 0
    budget_usd: Optional[float] = Field(default=None, description="USD limit for the run (on top of provider budgets)")
    retry_failed: bool = Field(default=False, description="rerun every failed plan, not only transient failures")


def run_config(path: Path, config: RunSettings, pool: PoolResource, planner: PlannerResource,
               storage: StorageResource) -> runner.RunConfig:
    return runner.RunConfig(
        queries=Path(path).resolve(), pool=Path(pool.path).resolve(), data_dir=Path(storage.data_dir),
        samples=config.samples, planner=planner.kind, planner_options=planner.options(),
        seed=config.seed, max_steps=planner.max_steps, cache=storage.use_cache,
        budget_usd=config.budget_usd, retry_failed=config.retry_failed, progress=False,
        setting_names={"budget_usd": "budget_usd", "max_depth": "max_depth", "cost_penalty": "cost_penalty"})


def _noted(context: AssetExecutionContext, run: runner.Run) -> dict:
    """A setting of this materialization that differs from the run's, as `conductor run` prints it:
    a warning in the step's log and the asset's `notes`, so a rerun with another budget says what it did."""
    for note in run.notes:
        context.log.warning("run %s: %s", run.dir.run_id, note)
    return {"notes": MetadataValue.json(list(run.notes))} if run.notes else {}


def _counts(column: pa.ChunkedArray) -> dict:
    return {(d["values"] if d["values"] is not None else "none"): d["counts"]
            for d in pc.value_counts(column).to_pylist()}


@asset(partitions_def=query_sets, group_name=GROUP,
       description="The partition's query-set file, validated; the run it belongs to is created (or reopened) here.")
def query_set(context: AssetExecutionContext, config: RunSettings, pool: PoolResource, planner: PlannerResource,
              storage: StorageResource, query_files: QueryFilesResource) -> Output[runner.RunConfig]:
    path = query_files.path_for(context.partition_key)
    if not path.exists():
        raise ConductorError(f"partition {context.partition_key}: no query-set file at {path} "
                             f"(drop the file into {query_files.inbox} and let the sensor add it)")
    cfg = run_config(path, config, pool, planner, storage)
    run = runner.prepare(cfg)
    cfg.run_id = run.dir.run_id
    return Output(cfg, metadata={
        **table_metadata(path, ["query_id", "task", "prompt", "reference"]),
        "run_id": run.dir.run_id, "resumed": run.resumed,
        "tasks": MetadataValue.json(_counts(run.queries.column("task"))),
    })


@asset(partitions_def=query_sets, group_name=GROUP, tags=POOLS_TAG,
       description="K sampled workflows per query, parsed and validated. An LLM planner holds a slot in its "
                   "provider's concurrency pool, a vLLM planner one in planner-vllm.")
def plans(context: AssetExecutionContext, query_set: runner.RunConfig) -> Output[runner.RunConfig]:
    failed_share_threshold()  # a typo in it must fail before an LLM planner is paid, not in the check after
    run = runner.prepare(query_set)
    with hold_pools(context, planner_pools(query_set.planner, query_set.planner_options, run.pool)) as held:
        path = runner.plan_stage(run)
    t = pq.read_table(path, columns=["valid", "prompt_tokens", "completion_tokens"])
    share = pc.mean(t.column("valid").cast("int8")).as_py() if t.num_rows else 0.0
    return Output(query_set, metadata={
        **table_metadata(path, ["plan_id", "valid", "n_steps", "workers", "error"]),
        "valid_share": share,
        "planner_tokens": (pc.sum(t.column("prompt_tokens")).as_py() or 0)
        + (pc.sum(t.column("completion_tokens")).as_py() or 0),
        "pools": MetadataValue.json(held),
    })


@asset(partitions_def=query_sets, group_name=GROUP, tags=POOLS_TAG,
       # Retrying is safe: the run resumes from its journal and finished plans are not paid twice.
       # A problem the user must fix (a missing key, a budget that cannot fit) fails at once instead.
       retry_policy=RetryPolicy(max_retries=3, delay=10, backoff=Backoff.EXPONENTIAL, jitter=Jitter.PLUS_MINUS),
       description="Every plan run against the pool: per-step traces and per-plan results. Holds one slot in "
                   "the concurrency pool of each provider of the pool file while it runs.")
def executions(context: AssetExecutionContext, plans: runner.RunConfig) -> Output[runner.RunConfig]:
    try:  # a configuration error (the pool file, the run id, a threshold) fails at once, not after three retries
        failed_share_threshold()
        run = runner.prepare(plans)
        sent = Progress(enabled=False)  # counts what this materialization sends
        with hold_pools(context, provider_pools(run.pool)) as held:
            results = runner.execute_stage(run, progress=sent)
    except GovernorDown as e:  # a Redis restart: the retry policy's later tries may find it back
        raise Failure(str(e), allow_retries=True) from None
    except ConductorError as e:
        raise Failure(str(e), allow_retries=False) from None
    except (KeyboardInterrupt, DagsterExecutionInterruptedError):
        # Terminated (the UI's Terminate, SIGINT, or SIGTERM when dagster dev is stopped): Dagster retries an
        # interrupted step that has a retry policy, which would send the very calls the user stopped.
        raise Failure("interrupted: the run was terminated, so no new call was sent; materialize the partition "
                      "again to resume it from its journal (calls cut off in flight are sent again, and counted "
                      "in the run's lost in flight)", allow_retries=False) from None
    t = pq.read_table(results, columns=["status", "cost_usd", "calls"])
    return Output(plans, metadata={
        **table_metadata(results, ["plan_id", "status", "cost_usd", "calls", "final_answer"]),
        "traces_rows": pq.ParquetFile(run.dir.table("traces")).metadata.num_rows,
        "run_id": run.dir.run_id, "traces_path": MetadataValue.path(str(run.dir.table("traces"))),
        "statuses": MetadataValue.json(_counts(t.column("status"))),
        "cost_usd": pc.sum(t.column("cost_usd")).as_py() or 0.0,
        "calls": pc.sum(t.column("calls")).as_py() or 0,
        # A rematerialization resumes the run: what this one sent, beside the run's totals above
        "new_cost_usd": round(sent.c.usd - sent.c.usd_resumed, 9),
        "new_calls": sent.c.calls,
        "new_requests": sent.c.requests,  # new_calls and the attempts that failed: what the provider saw
        "pools": MetadataValue.json(held),
        **_noted(context, run),
    })


@asset(partitions_def=query_sets, group_name=GROUP, description="Graded plans: reward and group advantage per plan.")
def rewards(context: AssetExecutionContext, executions: runner.RunConfig) -> Output[runner.RunConfig]:
    run = runner.prepare(executions)
    path = runner.grade_stage(run)
    t = pq.read_table(path, columns=["correct", "reward", "cost_usd"])
    correct = t.column("correct").drop_null()
    return Output(executions, metadata={
        **table_metadata(path, ["plan_id", "answer", "correct", "reward", "advantage"]),
        "accuracy": (pc.mean(correct.cast("int8")).as_py() if len(correct) else None),
        "mean_reward": pc.mean(t.column("reward")).as_py(),
        "cost_usd": pc.sum(t.column("cost_usd")).as_py() or 0.0,
        **_noted(context, run),
    })


@asset(partitions_def=query_sets, group_name=GROUP,
       description="The run's summary and accuracy/cost chart; refreshes the DuckDB catalog over all runs.")
def run_report(rewards: runner.RunConfig) -> Output[dict]:
    run = runner.prepare(rewards)
    summary = runner.report_stage(run)
    rows = stats.by_task(run.dir.table("rewards"))
    chart = accuracy_cost_chart(rows, run.dir.path / "report.png", f"run {run.dir.run_id}")
    return Output(summary, metadata={
        **rows_metadata(rows, stats.BY_TASK),
        "summary": MetadataValue.md(summary_markdown(summary)),
        "chart": png_markdown(chart, "accuracy and cost by task"),
        "chart_path": MetadataValue.path(str(chart)),
        "accuracy": summary["accuracy"], "cost_usd": summary["cost_usd"],
        "cost_per_query_usd": summary["cost_per_query_usd"], "catalog": MetadataValue.path(summary["catalog"]),
    })


# ---- enrichment over every run ------------------------------------------------

class EnrichSettings(Config):
    min_plans: Optional[int] = Field(
        default=None, ge=1,
        description="leave out worker/task pairs seen in fewer plans (unset: the enrich resource's min_plans, "
                    "from CONDUCTOR_ENRICH_MIN_PLANS, default 1)")


@asset(deps=[run_report], group_name=GROUP,
       description="Per worker and task, over every run: plans, accuracy when used, cost, latency and error "
                   "rate; the observed skills to set in the pool file. Refreshes the DuckDB catalog.")
def worker_stats(config: EnrichSettings, storage: StorageResource, enrich: EnrichResource) -> MaterializeResult:
    min_plans = config.min_plans if config.min_plans is not None else enrich.min_plans
    data = Path(storage.data_dir).resolve()
    catalog = refresh_catalog(data)
    runs = data / "runs"
    table = stats.worker_stats(runs, int(min_plans))
    out = data / "enrichment" / "worker_stats.parquet"
    write_table(out, table)
    return MaterializeResult(metadata={
        **table_metadata(out, ["worker", "task", "plans", "accuracy_when_used", "cost_usd"]),
        "runs": sum(1 for _ in runs.glob("*/rewards.parquet")),
        "min_plans": int(min_plans),
        "cost_usd": pc.sum(table.column("cost_usd")).as_py() or 0.0,
        "catalog": MetadataValue.path(str(catalog)),
    })
