"""The daily schedule: the enrichment job at a configured time, with its run config."""

import os

from dagster import DefaultScheduleStatus, RunConfig, ScheduleDefinition

from assets.pipeline import EnrichSettings
from pipelines.jobs import enrich_catalog


def daily_enrichment(env=os.environ) -> ScheduleDefinition:
    """CONDUCTOR_ENRICH_CRON (default 03:00 UTC daily) and CONDUCTOR_ENRICH_MIN_PLANS configure it."""
    return ScheduleDefinition(
        name="daily_enrichment", job=enrich_catalog,
        cron_schedule=env.get("CONDUCTOR_ENRICH_CRON", "0 3 * * *"), execution_timezone="UTC",
        run_config=RunConfig(ops={"worker_stats": EnrichSettings(
            min_plans=int(env.get("CONDUCTOR_ENRICH_MIN_PLANS", "1")))}),
        default_status=DefaultScheduleStatus.RUNNING,
        description="Daily: refresh the catalog and the per-worker statistics over every run.")
