"""The jobs: one partition's run of the pipeline, the daily enrichment, and one
day's run of every enrichment job file.

Run retries (instance `run_retries` in data/dagster_home/dagster.yaml) retry a
run whose worker process died; an asset that raised is retried by its own
RetryPolicy (executions) instead, and a blocking check that failed is not
retried at all, since it would fail again the same way."""

from dagster import AssetSelection, define_asset_job

PIPELINE = ["query_set", "plans", "executions", "rewards", "run_report"]

RETRY_TAGS = {
    "dagster/max_retries": "2",
    "dagster/retry_strategy": "FROM_FAILURE",  # resume at the failed step; earlier outputs are reused
    "dagster/retry_on_asset_or_op_failure": "false",
}

run_query_set = define_asset_job(
    "run_query_set", selection=AssetSelection.assets(*PIPELINE), tags=RETRY_TAGS,
    description="One query-set partition: plan, execute, grade, report (with their checks).")

enrich_catalog = define_asset_job(
    "enrich_catalog", selection=AssetSelection.assets("worker_stats"), tags=RETRY_TAGS,
    description="Refresh the DuckDB catalog and the per-worker statistics over every run.")

ENRICH_GROUP = "enrichment"

# Defined only when job files exist (an empty selection is not a job).
enrich_jobs = define_asset_job(
    "enrich_jobs", selection=AssetSelection.groups(ENRICH_GROUP), tags=RETRY_TAGS,
    description="One day of every enrichment job file: new or changed rows, their checks, then publishing.")
