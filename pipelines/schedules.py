"""The daily schedules: the catalog enrichment at a configured time, with its run
config, and every enrichment job file once a day for the day just ended.

A bad CONDUCTOR_ENRICH_* value is an error naming the variable: the times are
needed to define the schedules, so a bad cron or hour stops the code location
from loading (the hour is checked whether or not there are job files); a bad
CONDUCTOR_ENRICH_MIN_PLANS fails the schedule's ticks here, and every other run
of enrich_catalog at its start (the `enrich` resource, assets/resources.py)."""

import os

from dagster import (
    DagsterInvalidDefinitionError,
    DefaultScheduleStatus,
    RunConfig,
    ScheduleDefinition,
    build_schedule_from_partitioned_job,
)

from conductor.errors import ConductorError
from assets.pipeline import EnrichSettings
from assets.resources import enrich_min_plans
from conductor.envsettings import env_number
from pipelines.jobs import enrich_catalog, enrich_jobs


def daily_enrichment(env=os.environ) -> ScheduleDefinition:
    """CONDUCTOR_ENRICH_CRON (default 03:00 UTC daily) and CONDUCTOR_ENRICH_MIN_PLANS configure it."""
    cron = env.get("CONDUCTOR_ENRICH_CRON", "0 3 * * *")

    def run_config(_context) -> RunConfig:
        return RunConfig(ops={"worker_stats": EnrichSettings(min_plans=enrich_min_plans(env))})

    try:
        return ScheduleDefinition(
            name="daily_enrichment", job=enrich_catalog, cron_schedule=cron, execution_timezone="UTC",
            run_config_fn=run_config, default_status=DefaultScheduleStatus.RUNNING,
            description="Daily: refresh the catalog and the per-worker statistics over every run.")
    except DagsterInvalidDefinitionError as e:
        raise ConductorError(f"CONDUCTOR_ENRICH_CRON={cron!r}: expected a cron schedule such as '0 3 * * *' "
                             f"({e})") from None


def enrich_jobs_hour(env=os.environ) -> int:
    """CONDUCTOR_ENRICH_JOBS_HOUR (UTC, default 4), or an error naming it."""
    return env_number(env, "CONDUCTOR_ENRICH_JOBS_HOUR", 4, "an hour of the day (UTC), a whole number 0 to 23",
                      lambda v: 0 <= v <= 23, kind=int)


def daily_enrich_jobs(env=os.environ) -> ScheduleDefinition:
    """CONDUCTOR_ENRICH_JOBS_HOUR (UTC, default 4) sets when the day's partition runs."""
    hour = enrich_jobs_hour(env)
    return build_schedule_from_partitioned_job(
        enrich_jobs, name="daily_enrich_jobs", hour_of_day=hour,
        default_status=DefaultScheduleStatus.RUNNING,
        description="Daily: every enrichment job file on its input as it stands; only new or changed rows are paid for.")
