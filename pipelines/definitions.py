"""The one Definitions object: every asset, check, job, sensor, schedule and
resource of the code location, on top of everything else: `assets/` (the domain
modules with their assets, checks, resources and partitions) never imports
`pipelines/`.

Asset modules under `assets/` (and their checks) are found automatically, so a
new domain module needs no edit here; each job file in jobs/ (CONDUCTOR_JOBS_DIR)
adds its assets (assets/enrichment.py) and, when there is one, the daily job schedule. Settings come from CONDUCTOR_*
environment variables with defaults that work from the repository root (see
assets/resources.py); a bad CONDUCTOR_ENRICH_START, like a bad schedule time
(CONDUCTOR_ENRICH_CRON, CONDUCTOR_ENRICH_JOBS_HOUR, job files or not), stops the
location from loading with an error naming it."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import assets  # noqa: E402
from assets import resources  # noqa: E402
from assets.enrichment import JOB_ASSETS  # noqa: E402
from dagster import (  # noqa: E402
    Definitions,
    load_asset_checks_from_package_module,
    load_assets_from_package_module,
)
from pipelines import executors, jobs, schedules, sensors  # noqa: E402

# The daily job schedule exists only with job files, but a bad hour stops the location either
# way: otherwise it would go unnoticed until the first job file is added.
schedules.enrich_jobs_hour()

defs = Definitions(
    assets=load_assets_from_package_module(assets),
    asset_checks=load_asset_checks_from_package_module(assets),
    jobs=[jobs.run_query_set, jobs.enrich_catalog, *([jobs.enrich_jobs] if JOB_ASSETS else [])],
    sensors=[sensors.query_set_inbox, sensors.dead_runs],
    schedules=[schedules.daily_enrichment(), *([schedules.daily_enrich_jobs()] if JOB_ASSETS else [])],
    resources=resources.from_env(),
    executor=executors.executor_from_env(),
)
