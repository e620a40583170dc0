"""The daily schedules: the catalog enrichment at a configured time, with its run
config, and every enrichment job file once a day for the day just ended."""

import os

from dagster import DefaultScheduleStatus, RunConfig, ScheduleDefinition, build_schedule_from_partitioned_job

from assets.pipeline import EnrichSettings
from pipelines.jobs import enrich_catalog, enrich_jobs


def daily_enrichment(env=os.environ) -> ScheduleDefinition:
    """CONDUCTOR_ENRICH_CRON (default 03:00 UTC daily) and CONDUCTOR_ENRICH_MIN_PLANS configure it."""
    return ScheduleDefinition(
        name="daily_enrichment", job=enrich_catalog,
        cron_schedule=env.get("CONDUCTOR_ENRICH_CRON", "0 3 * * *"), execution_timezone="UTC",
        run_config=RunConfig(ops={"worker_stats": EnrichSettings(
            min_plans=int(env.get("CONDUCTOR_ENRICH_MIN_PLANS", "1")))}),
        default_status=DefaultScheduleStatus.RUNNING,
        description="Daily: refresh the catalog and the per-worker statistics over every run.")


def daily_enrich_jobs(env=os.environ) -> ScheduleDefinition:
    """CONDUCTOR_ENRICH_JOBS_HOUR (UTC, default 4) sets when the day's partition runs."""
    return build_schedule_from_partitioned_job(
        enrich_jobs, name="daily_enrich_jobs", hour_of_day=int(env.get("CONDUCTOR_ENRICH_JOBS_HOUR", "4")),
        default_status=DefaultScheduleStatus.RUNNING,
        description="Daily: every enrichment job file on its input as it stands; only new or changed rows are paid for.")
