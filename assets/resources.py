"""Dagster resources: the worker pool, the planner, where files live, the check
thresholds and the enrichment's settings, configured in one place and handed to
the assets, sensor and checks, which pass them on to `conductor` as plain settings.

`from_env` builds them for the code location: every setting has a default that
works from the repository root, and a CONDUCTOR_* environment variable to move
it (the browser test points them all at a temporary folder)."""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path
from typing import Mapping, Optional

import orjson
from dagster import (
    ConfigurableResource,
    DailyPartitionsDefinition,
    FilesystemIOManager,
    InitResourceContext,
    ResourceDefinition,
    resource,
)
from pydantic import Field

from conductor.envsettings import env_number
from conductor.errors import ConductorError
from conductor.planners import PLANNERS

# A partition key is the query-set file's name without ".parquet"; keys travel in
# URLs, CLI selections and run tags, so they keep to a plain alphabet.
PARTITION_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")


class PoolResource(ConfigurableResource):
    """Which pool file the runs use. Keys are read from the environment by name."""

    path: str = Field(default="data/pools/sim.yaml", description="pool file (YAML)")


class PlannerResource(ConfigurableResource):
    """Which planner writes the workflows, and its settings."""

    kind: str = Field(default="embedded", description="embedded | vllm | llm")
    model: Optional[str] = Field(default=None, description="vllm: model path; llm: litellm model string")
    options_json: str = Field(default="{}", description="planner settings as a JSON object")
    max_steps: int = 5

    def options(self) -> dict:
        """The planner's options for conductor. A kind, model or options value that cannot work is
        refused first, naming its variable: the `plans` step would otherwise name a concurrency
        pool after a kind that does not exist, or report the model as an unknown option."""
        _check_kind(self.kind)
        opts = _parsed_options(self.options_json)
        if self.model:
            _check_model_fits(self.kind, self.model)
            opts["model"] = self.model
        if self.kind == "vllm" and not opts.get("model"):
            raise ConductorError("CONDUCTOR_PLANNER='vllm' (the planner resource's kind) needs "
                                 "CONDUCTOR_PLANNER_MODEL (the resource's model): a model path or name vLLM can load")
        return opts


def _check_kind(kind: str) -> None:
    """Only conductor's planners: any other name fails at planning, after a pool was made for it."""
    if kind not in PLANNERS:
        raise ConductorError(f"CONDUCTOR_PLANNER={kind!r} (the planner resource's kind): expected one of "
                             f"{', '.join(PLANNERS)}")


def _check_model_fits(kind: str, model: str) -> None:
    """A model is for the vllm and llm planners; conductor would call it an unknown option."""
    if kind == "embedded":
        raise ConductorError(f"CONDUCTOR_PLANNER_MODEL={model!r} (the planner resource's model) needs "
                             f"CONDUCTOR_PLANNER=vllm or CONDUCTOR_PLANNER=llm: the embedded planner (the "
                             f"default) uses no model; set CONDUCTOR_PLANNER, or unset CONDUCTOR_PLANNER_MODEL")


def _parsed_options(options_json: str) -> dict:
    """CONDUCTOR_PLANNER_OPTIONS as a dict, or an error naming it."""
    try:
        opts = orjson.loads(options_json or "{}")
        why = "" if isinstance(opts, dict) else f"got {type(opts).__name__}"
    except orjson.JSONDecodeError as e:
        why = str(e)
    if why:
        raise ConductorError(f"planner options {options_json!r} (CONDUCTOR_PLANNER_OPTIONS, or the planner "
                             f"resource's options_json): expected a JSON object such as "
                             f"{{\"templates\": [\"verify\"]}} ({why})")
    return opts


class StorageResource(ConfigurableResource):
    """Where runs, the response cache and the DuckDB catalog live."""

    data_dir: str = "data"
    use_cache: bool = True


class QueryFilesResource(ConfigurableResource):
    """The folders of the inbox flow: new files arrive in `inbox`; accepted ones
    move to `store` (one file per partition, `<key>.parquet`); rejected ones move
    to `rejected` with `<file>.reason.txt` beside them."""

    inbox: str = Field(default="data/inbox", description="folder the sensor watches")
    store: str = Field(default="data/query_sets", description="accepted query sets, one per partition")
    rejected: str = Field(default="data/rejected", description="files that failed validation")
    settle_seconds: float = Field(
        default=2.0, description="ignore files modified more recently than this (still being copied)")
    max_files_per_tick: int = Field(default=20, description="files validated per sensor tick")

    def path_for(self, partition_key: str) -> Path:
        return Path(self.store) / f"{partition_key}.parquet"


class ChecksResource(ConfigurableResource):
    """Thresholds of the asset checks."""

    min_valid_share: float = Field(default=0.9, ge=0.0, le=1.0,
                                   description="least share of plans that must be valid")
    max_run_usd: Optional[float] = Field(
        default=None, ge=0.0,
        description="spend limit per run, on top of the run's budget_usd and the pool's provider budgets")


ENRICH_MIN_PLANS = "CONDUCTOR_ENRICH_MIN_PLANS"


def enrich_min_plans(env: Mapping[str, str] = os.environ) -> int:
    """CONDUCTOR_ENRICH_MIN_PLANS (default 1), or an error naming it."""
    return env_number(env, ENRICH_MIN_PLANS, 1, "a whole number of plans, at least 1", lambda v: v >= 1, kind=int)


class EnrichResource(ConfigurableResource):
    """Settings of the enrichment over every run (worker_stats), for every run of the job: the
    schedule's ticks, `dagster job execute` and the UI's launchpad alike."""

    min_plans: int = Field(default=1, ge=1, description=f"leave out worker/task pairs seen in fewer plans "
                                                        f"({ENRICH_MIN_PLANS}; a run's worker_stats config "
                                                        f"min_plans overrides it)")


class CheckedFilesystemIOManager(FilesystemIOManager):
    """The IO manager of CONDUCTOR_IO_DIR, whose folder is tried when a run's resources start, in
    the process that writes there (on Kubernetes, each step's pod): a folder it cannot create or
    write otherwise failed the first step after its work, with a bare FileNotFoundError."""

    def create_io_manager(self, context: InitResourceContext):
        check_io_dir(self.base_dir or "")
        return super().create_io_manager(context)


def check_io_dir(folder: str) -> None:
    """Create the folder and write a file in it, or say which variable names it and what it takes."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConductorError(f"CONDUCTOR_IO_DIR={folder!r}: cannot create or write the folder ({e.strerror or e}); "
                             f"expected a folder this process can create and write (on Kubernetes, a volume "
                             f"every step's pod mounts)") from None


ENRICH_START = "CONDUCTOR_ENRICH_START"


def check_enrich_start(env: Mapping[str, str] = os.environ) -> None:
    """CONDUCTOR_ENRICH_START, parsed as assets/partitions.py parses it, or an error naming it:
    Dagster's own names no variable. The days are needed to define the enrichment assets and
    schedule, so a bad value stops the code location from loading, like a bad
    CONDUCTOR_ENRICH_JOBS_HOUR."""
    raw = env.get(ENRICH_START)
    if raw is None:
        return
    try:
        DailyPartitionsDefinition(start_date=raw, timezone="UTC")
    except ValueError:
        raise ConductorError(f"{ENRICH_START}={raw!r}: expected the first day of the daily enrichment partitions "
                             f"as a date YYYY-MM-DD, such as 2026-01-01 (the default when unset)") from None


def unusable(key: str, message: str) -> ResourceDefinition:
    """Stands in for a resource whose settings are wrong: the code location still loads, and only
    the runs that use the resource fail, at their start, with the message."""
    @resource(description=f"not usable: {message}")
    def _unusable(_):
        raise ConductorError(f"resource {key}: {message}")
    return _unusable


def checks_from_env(env: Mapping[str, str]) -> ChecksResource:
    return ChecksResource(
        min_valid_share=env_number(env, "CONDUCTOR_MIN_VALID_SHARE", 0.9, "a share between 0 and 1, e.g. 0.9",
                                   lambda v: 0 <= v <= 1),
        max_run_usd=env_number(env, "CONDUCTOR_MAX_RUN_USD", None, "a finite USD amount, at least 0 (unset: no limit)",
                               lambda v: 0 <= v < math.inf))


def from_env(env: Mapping[str, str] = os.environ) -> dict:
    """The code location's resources; CONDUCTOR_* variables override the defaults.
    CONDUCTOR_IO_DIR moves the values passed between assets (small run
    configurations) off DAGSTER_HOME, to a folder every step's pod mounts."""
    data = env.get("CONDUCTOR_DATA_DIR", "data")
    try:
        checks: ChecksResource | ResourceDefinition = checks_from_env(env)
    except ConductorError as e:
        checks = unusable("checks", str(e))
    try:  # a bad value fails each run of the enrichment at its start, not the whole code location
        enrich: EnrichResource | ResourceDefinition = EnrichResource(min_plans=enrich_min_plans(env))
    except ConductorError as e:
        enrich = unusable("enrich", str(e))
    res: dict = {
        "pool": PoolResource(path=env.get("CONDUCTOR_POOL", "data/pools/sim.yaml")),
        "planner": PlannerResource(kind=env.get("CONDUCTOR_PLANNER", "embedded"),
                                   model=env.get("CONDUCTOR_PLANNER_MODEL") or None,
                                   options_json=env.get("CONDUCTOR_PLANNER_OPTIONS", "{}")),
        "storage": StorageResource(data_dir=data),
        "query_files": QueryFilesResource(
            inbox=env.get("CONDUCTOR_INBOX", str(Path(data) / "inbox")),
            store=env.get("CONDUCTOR_QUERY_SETS", str(Path(data) / "query_sets")),
            rejected=env.get("CONDUCTOR_REJECTED", str(Path(data) / "rejected"))),
        "checks": checks,
        "enrich": enrich,
    }
    if env.get("CONDUCTOR_IO_DIR"):
        res["io_manager"] = CheckedFilesystemIOManager(base_dir=env["CONDUCTOR_IO_DIR"])
    return res
