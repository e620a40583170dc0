"""Enrichment jobs as Dagster assets: each job file in the jobs folder
(CONDUCTOR_JOBS_DIR, default `jobs/`) becomes a small group, partitioned by day:

    enrich/<job>/records    runs the job (only new or changed rows are paid for)
    enrich/<job>/published  the job's newest run's records, one per id with its `status`
                            (a row without a valid record has null fields; no older
                            valid record stands in for it), for downstream readers

with blocking checks on `records`: the schema-valid share is at least the job's
`quality.min_valid_share`, ids are unique, and no budget stopped a row or left a
record unjudged (the run is unfinished: `conductor job run` exits 3). A failing
check stops `published`, so a bad or unfinished run never replaces what readers see.

Job files are only glanced at (their `name`) when the code location loads; they
are read and checked in full when a partition materializes, so one bad file
(not UTF-8, not YAML, a bad key) fails its own asset with a message naming file,
key and line, not the location. A YAML file that is clearly not a job file, a
pool file kept beside the jobs (`pool: pool.yaml`: top-level `workers` or
`providers` and none of a job's required keys), makes no asset; the code
location's log names each file left out and why.
The day of a partition does not filter the input: each run reads the file as it
stands, and the incremental run pays only for rows that changed since.
"""


import logging
import os
import re
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml
from dagster import (
    AssetCheckResult,
    AssetChecksDefinition,
    AssetExecutionContext,
    AssetIn,
    AssetKey,
    AssetsDefinition,
    Config,
    Failure,
    MetadataValue,
    Output,
    asset,
    asset_check,
)
from pydantic import Field

from conductor.enrich.run import OK as VALID_STATUS  # the status of a record that parsed and validated
from conductor import yamlkeys
from conductor.errors import ConductorError
from conductor.pool import load_pool
from conductor.report import markdown_table
from conductor.store import refresh_catalog, write_table
from assets.checks import evaluate_unique_ids
from assets.concurrency import POOLS_TAG, hold_pools, provider_pools
from assets.metadata import table_metadata
from assets.partitions import days
from assets.resources import StorageResource

GROUP = "enrichment"
PREFIX = "enrich"
_NAME = re.compile(r"^[a-z][a-z0-9_]*\Z")  # \Z: `$` lets "abc\n" through, not a Dagster name
# What load_job requires at the top of every job file (conductor/enrich/job.py, its `_req` calls), and
# the top-level keys of a pool file: a YAML file with a pool key and none of these is a pool file.
JOB_REQUIRED_KEYS = ("name", "input", "prompt", "pool")
POOL_KEYS = ("workers", "providers")
_PREVIEW_ROWS = 5
JOB_SUFFIXES = (".yaml", ".yml")


class JobRunSettings(Config):
    full_refresh: bool = Field(default=False, description="recompute every row, not only new or changed ones")


def jobs_dir(env=os.environ) -> Path:
    return Path(env.get("CONDUCTOR_JOBS_DIR", "jobs"))


def _glance(path: Path) -> Any:
    """The file's YAML document, read without checking it; None when it cannot be read
    (the full check at run time says why, naming the file). Nothing in a job file may
    stop the code location from loading."""
    try:
        return yamlkeys.load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError, yaml.YAMLError):
        # OSError: unreadable. ValueError: not UTF-8 (UnicodeDecodeError), or a value PyYAML cannot
        # build (a date such as 2026-13-45, an integer past Python's 4300-digit limit).
        # RecursionError: nesting too deep for PyYAML's composer.
        return None


def _name(path: Path, raw: Any) -> str:
    name = raw.get("name") if isinstance(raw, dict) else None
    if isinstance(name, str) and _NAME.match(name):
        return name
    return re.sub(r"[^a-z0-9_]", "_", path.stem.lower()) or "job"


def job_name(path: Path) -> str:
    """The job's `name`, read without checking the rest of the file; the file's
    stem when the name cannot be read (the full check reports why at run time)."""
    return _name(path, _glance(path))


def not_a_job(raw: Any) -> str | None:
    """Why a YAML file in the jobs folder is clearly not a job file, or None when it may be one.
    Only a pool file is recognized: a top-level pool key (workers, providers) and none of the keys
    every job file must have. A job file with mistakes (a missing key, bad YAML, not UTF-8) is a
    job file: it gets its asset, which fails naming the file, key and line."""
    if not isinstance(raw, dict) or any(k in raw for k in JOB_REQUIRED_KEYS):
        return None
    pool = [k for k in POOL_KEYS if k in raw]
    if not pool:
        return None
    return (f"a pool file, not a job file: it has {' and '.join(pool)} and none of the keys a job file "
            f"must have ({', '.join(JOB_REQUIRED_KEYS)})")


def _load(path: Path):
    from conductor.enrich import load_job

    try:
        return load_job(path)
    except ConductorError as e:
        raise Failure(str(e), allow_retries=False) from None


def job_assets(path: str | Path) -> tuple[list[AssetsDefinition], list[AssetChecksDefinition]]:
    """The records and published assets of one job file, and their checks."""
    path = Path(path).absolute()  # not resolve(): a symlink loop in the jobs folder must not stop the location
    name = job_name(path)
    records_key = AssetKey([PREFIX, name, "records"])

    @asset(key=records_key, partitions_def=days, group_name=GROUP, tags=POOLS_TAG,
           description=f"Job {path.name}: one typed record per input row; only new or changed rows are sent. "
                       "Holds a slot in the concurrency pool of each provider of the job's pool.")
    def records(context: AssetExecutionContext, config: JobRunSettings, storage: StorageResource) -> Output[dict]:
        from conductor.enrich import run_job

        job = _load(path)
        with hold_pools(context, provider_pools(load_pool(job.pool_path))) as held:
            try:
                summary = run_job(job, data_dir=Path(storage.data_dir), full_refresh=config.full_refresh,
                                  progress=False)
            except ConductorError as e:
                raise Failure(str(e), allow_retries=False) from None
        out = {**summary, "job": job.name, "id_column": job.id_column,
               "min_valid_share": float(job.quality.get("min_valid_share", 0.95)),
               "records_path": str(summary["records_path"])}
        return Output(out, metadata=records_metadata(Path(out["records_path"]), out, held))

    @asset_check(asset=records_key, partitions_def=days, name="schema_valid_share", blocking=True,
                 description="Share of rows with a schema-valid record >= the job's quality.min_valid_share.")
    def valid_share_check(records: dict) -> AssetCheckResult:
        return evaluate_valid_share(Path(records["records_path"]), records["min_valid_share"])

    @asset_check(asset=records_key, partitions_def=days, name="unique_ids", blocking=True,
                 description="The id column is unique and never null.")
    def unique_ids_check(records: dict) -> AssetCheckResult:
        return evaluate_unique_ids(Path(records["records_path"]), [records["id_column"]])

    @asset_check(asset=records_key, partitions_def=days, name="no_budget_stop", blocking=True,
                 description="No row stopped and no record left unjudged by a budget; else raise the job's "
                             "budget_usd and rematerialize: finished rows are not paid again.")
    def budget_stop_check(records: dict) -> AssetCheckResult:
        return evaluate_job_budget_stop(records)

    @asset(key=AssetKey([PREFIX, name, "published"]), partitions_def=days, group_name=GROUP,
           ins={"records": AssetIn(key=records_key)},
           description=f"Job {path.name}: the records of its newest run (the catalog view), "
                       "written for downstream readers once the checks on records pass.")
    def published(records: dict, storage: StorageResource) -> Output[str]:
        data = Path(storage.data_dir).resolve()
        out = data / "enrichment" / f"{records['job']}.parquet"
        table = newest_records(data, records["job"])
        write_table(out, table)
        return Output(str(out), metadata={**table_metadata(out, _preview_columns(table.schema, records["id_column"])),
                                          "published_path": MetadataValue.path(str(out)),
                                          "run_id": records["run_id"]})

    return [records, published], [valid_share_check, unique_ids_check, budget_stop_check]


def job_files_in(folder: Path) -> list[Path]:
    """The YAML files of the jobs folder, `.yaml` and `.yml` (any case) alike, as `conductor job`
    takes both: a `.yml` job was left out without a word. Sorted by name, so of two files giving
    one job name (`a.yaml` and `a.yml` with no readable `name`) the first is kept, with a warning
    naming both."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in JOB_SUFFIXES)


def all_job_assets(folder: Path | None = None, env=os.environ) -> tuple[list[AssetsDefinition],
                                                                         list[AssetChecksDefinition]]:
    """The assets of every job file. A YAML file that is clearly not a job file (a pool file kept
    beside the jobs, see `not_a_job`) is left out, with a warning naming it and why. A
    CONDUCTOR_JOBS_DIR naming a missing folder, or one without job files, is logged: without it the
    enrichment group, its job and schedule would vanish without a word (the default folder may be
    absent: then there are simply no jobs)."""
    log = logging.getLogger(__name__)
    named = folder is None and bool(env.get("CONDUCTOR_JOBS_DIR"))
    if folder is None:
        folder = jobs_dir(env)
    job_files: list[tuple[Path, Any]] = []
    left_out: list[str] = []
    for path in job_files_in(folder):
        raw = _glance(path)
        if (why := not_a_job(raw)) is not None:
            log.warning("%s is left out of the enrichment jobs: %s", path, why)
            left_out.append(path.name)
            continue
        job_files.append((path, raw))
    if named and not job_files:
        log.warning(
            "CONDUCTOR_JOBS_DIR=%s: %s, so there are no enrichment job assets, no enrich_jobs job and no "
            "daily_enrich_jobs schedule", env["CONDUCTOR_JOBS_DIR"],
            (f"no job files ({', '.join('*' + e for e in JOB_SUFFIXES)}) in {folder.resolve()}"
             + (f" ({', '.join(left_out)} left out: not job files)" if left_out else ""))
            if folder.is_dir() else f"no folder {folder.resolve()}")
    assets: list[AssetsDefinition] = []
    checks: list[AssetChecksDefinition] = []
    seen: dict[str, Path] = {}
    for path, raw in job_files:
        name = _name(path, raw)
        if name in seen:  # two files, one asset key: keep the first, the run of the second would clash anyway
            log.warning("job file %s is left out: job %r is already defined by %s", path, name, seen[name])
            continue
        seen[name] = path
        a, c = job_assets(path)
        assets += a
        checks += c
    return assets, checks


# ---- what the assets and checks show --------------------------------------------

def evaluate_job_budget_stop(records: dict) -> AssetCheckResult:
    stopped = int((records.get("statuses") or {}).get("budget_exhausted") or 0)
    unjudged = int(records.get("judge_budget_exhausted") or 0)
    what = [f"{stopped} row(s) stopped by a budget" if stopped else "",
            f"{unjudged} record(s) left unjudged (or not yet rescored) by the budget" if unjudged else ""]
    desc = ("; ".join(w for w in what if w) + ": the run is unfinished. Raise the job file's budget_usd (or the "
            "provider's in the pool file) and rematerialize the day: finished rows are not paid again"
            if stopped or unjudged else "no row stopped by a budget")
    return AssetCheckResult(passed=not (stopped or unjudged), description=desc,
                            metadata={"budget_exhausted": stopped, "judge_budget_exhausted": unjudged})


def records_metadata(path: Path, summary: dict[str, Any], held: list[str]) -> dict:
    t = pq.read_table(path)
    rows = t.num_rows
    metrics = summary.get("metrics") or {}
    per_field = metrics.get("fields") if isinstance(metrics.get("fields"), dict) else {}
    fields = [f for f in per_field if f in t.column_names] or _field_columns(t, summary)
    # null share among valid records (a failed row has no values to be null), as run_job reports it
    valid = pc.fill_null(pc.equal(t.column("status"), VALID_STATUS), False) if "status" in t.column_names else None
    kept = t.filter(valid) if valid is not None else t
    nulls = {f: (kept.column(f).null_count / kept.num_rows if kept.num_rows else None) for f in fields}
    md = {
        **table_metadata(path, _preview_columns(t.schema, summary["id_column"])),
        "run_id": summary.get("run_id"),
        "records_path": MetadataValue.path(str(path)),
        "rows": rows,
        "computed": summary.get("computed"), "reused": summary.get("reused"),
        "valid": summary.get("valid"), "failed": summary.get("failed"),
        "statuses": MetadataValue.json(_jsonable(summary.get("statuses") or {})),
        "cost_usd": float(summary.get("cost_usd") or 0.0),
        "calls": summary.get("calls"),
        # the judge is a run of its own: its spend is not in cost_usd and calls
        "judge_cost_usd": float(summary.get("judge_cost_usd") or 0.0),
        "judge_budget_exhausted": int(summary.get("judge_budget_exhausted") or 0),
        "overall_score": metrics.get("overall"),
        "null_share": MetadataValue.json(nulls),
        "metrics": MetadataValue.json(_jsonable(metrics)),
        "fields": MetadataValue.md(markdown_table(
            [{"field": f, "null_share": nulls[f], "accuracy": _accuracy(metrics, f),
              "mean_confidence": (per_field.get(f) or {}).get("mean_confidence")} for f in fields],
            ["field", "null_share", "accuracy", "mean_confidence"])),
        "pools": MetadataValue.json(held),
    }
    return {k: v for k, v in md.items() if v is not None}


def _field_columns(t: pa.Table, summary: dict[str, Any]) -> list[str]:
    """Field columns when the summary does not list them: what is neither the id,
    a record column nor a confidence."""
    from conductor.enrich.job import RESERVED

    skip = {summary["id_column"], *RESERVED}
    return [c for c in t.column_names if c not in skip and not c.endswith("_confidence")]


def _accuracy(metrics: dict[str, Any], field: str) -> float | None:
    acc = metrics.get("accuracy")
    if isinstance(acc, dict) and isinstance(acc.get(field), (int, float)):
        return float(acc[field])
    per = metrics.get("fields")
    if isinstance(per, dict) and isinstance(per.get(field), dict):
        v = per[field].get("accuracy")
        return float(v) if isinstance(v, (int, float)) else None
    return None


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def _preview_columns(schema: pa.Schema, id_column: str) -> list[str]:
    names = [n for n in schema.names if n not in ("row_hash", "updated_at")]
    first = [n for n in (id_column, "status") if n in names]
    return first + [n for n in names if n not in first][: 8 - len(first)]


def evaluate_valid_share(path: Path, threshold: float) -> AssetCheckResult:
    """Share of rows whose record is schema-valid (status ok); failures are listed."""
    t = pq.read_table(path, columns=[c for c in ("status", "error") if c in pq.ParquetFile(path).schema_arrow.names])
    n = t.num_rows
    ok = pc.fill_null(pc.equal(t.column("status"), VALID_STATUS), False)
    valid = pc.sum(ok.cast("int64")).as_py() or 0
    share = valid / n if n else 0.0
    bad = pc.filter(t, pc.invert(ok))
    statuses = {str(d["values"]): d["counts"] for d in pc.value_counts(bad.column("status")).to_pylist()}
    shown = bad.slice(0, _PREVIEW_ROWS).to_pylist()
    return AssetCheckResult(
        passed=n > 0 and share >= threshold,
        description=f"{valid} of {n} records schema-valid ({share:.1%}); threshold {threshold:.1%}",
        metadata={"valid_share": share, "threshold": threshold, "rows": n, "not_valid": n - valid,
                  "statuses": MetadataValue.json(statuses),
                  "examples": MetadataValue.md(markdown_table(shown, [c for c in ("status", "error")
                                                                        if c in t.column_names]))})


def newest_records(data_dir: Path, job: str) -> pa.Table:
    """The job's catalog view: the records of its newest run, with the records' own Arrow types.
    DuckDB hands a zoned timestamp back in its session's zone, named its own way
    (`timestamp[us, tz=Etc/UTC]` for the records' `timestamp[us, tz=UTC]` `updated_at`), and
    a timestamp in ms as us: a reader comparing `published` with `records.parquet`, or
    concatenating them, saw two types."""
    db = refresh_catalog(Path(data_dir))
    with duckdb.connect(str(db), read_only=True) as con:
        try:
            table = con.execute(f'SELECT * FROM "{job}"').to_arrow_table()
        except duckdb.CatalogException as e:
            raise ConductorError(f"catalog {db}: no view {job!r} for the job's records ({e})") from None
    return _as_records(table, Path(data_dir), job)


def _as_records(table: pa.Table, data_dir: Path, job: str) -> pa.Table:
    """`table` cast to the schema of the job's newest records file (the file its view reads);
    unchanged if that file is not found or has other columns (a newer run landed meanwhile),
    but for `updated_at`, which is always UTC."""
    from conductor.store import job_runs

    entry = job_runs(Path(data_dir).resolve() / "runs").get(job)
    try:
        schema = pq.read_schema(entry["files"][0]) if entry else None
    except (OSError, pa.ArrowException):
        schema = None
    if schema is not None and schema.names == table.schema.names:
        try:
            return table.cast(schema.remove_metadata())
        except pa.ArrowException:
            pass
    i = table.schema.get_field_index("updated_at")
    if i >= 0 and pa.types.is_timestamp(t := table.schema.field(i).type) and t.tz is not None:
        table = table.set_column(i, "updated_at", table.column(i).cast(pa.timestamp("us", tz="UTC")))
    return table


JOB_ASSETS, JOB_CHECKS = all_job_assets()
