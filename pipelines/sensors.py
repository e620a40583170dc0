"""The inbox sensor: a query-set file dropped into the inbox becomes a partition
and a run. And the dead-run sensor: a run whose worker process is gone is failed,
so that the instance's run retries resume it.

Each tick, every settled file in the inbox is validated with
`conductor.queries.load_queries`:
- valid: moved to the store as `<key>.parquet` (key = file name without
  ".parquet"); the partition is added and a run of `run_query_set` requested;
- invalid, badly named, not Parquet, or clashing with a partition that holds
  other content: moved to the rejected folder with `<file>.reason.txt` beside
  it, logged, and no run.
Files are moved, never deleted. Store files that have no partition yet (a
tick that died between the move and the partition) are picked up again, and
run keys carry the file's digest, so a tick can be repeated safely.
"""

import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dagster import (
    DagsterEventType,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from conductor.errors import InputError
from conductor.queries import file_digest, load_queries
from conductor.store import process_gone
from pipelines.jobs import run_query_set
from assets.concurrency import is_local
from assets.partitions import query_sets
from assets.resources import PARTITION_KEY_RE, QueryFilesResource


@dataclass
class InboxScan:
    accepted: dict[str, str] = field(default_factory=dict)  # partition key -> sha256 of the file
    rejected: dict[str, str] = field(default_factory=dict)  # rejected file's path -> reason
    waiting: list[str] = field(default_factory=list)  # files still being written, or over the tick's limit


def scan_inbox(files: QueryFilesResource, known_keys: set[str], now: float | None = None) -> InboxScan:
    """Validate and move the inbox's files; also list store files without a partition."""
    now = time.time() if now is None else now
    inbox, store, rejected = Path(files.inbox), Path(files.store), Path(files.rejected)
    scan = InboxScan()
    for path in sorted(store.glob("*.parquet")) if store.is_dir() else []:
        if path.stem not in known_keys and PARTITION_KEY_RE.match(path.stem):
            scan.accepted[path.stem] = file_digest(path)
    if not inbox.is_dir():
        return scan
    candidates = [p for p in sorted(inbox.iterdir())
                  if p.is_file() and not p.name.startswith(".") and not p.name.endswith((".tmp", ".part"))]
    for path in candidates:
        if now - path.stat().st_mtime < files.settle_seconds or \
                len(scan.accepted) + len(scan.rejected) >= files.max_files_per_tick:
            scan.waiting.append(str(path))
            continue
        key, reason = path.stem, None
        if path.suffix != ".parquet":
            reason = f"{path.name}: not a query set; the inbox takes Parquet files named <key>.parquet"
        elif not PARTITION_KEY_RE.match(key):
            reason = (f"{path.name}: the name {key!r} cannot be a partition key; use letters, digits, "
                      f"'_', '-' and '.', starting with a letter or digit, at most 100 characters")
        else:
            try:
                load_queries(path)
            except InputError as e:
                reason = str(e)
        digest = None
        if reason is None:
            digest = file_digest(path)
            dest = store / path.name
            if dest.exists():
                same = file_digest(dest) == digest
                reason = (f"{path.name}: identical to query set {key!r}, already added ({dest}); nothing to do"
                          if same else
                          f"{path.name}: a query set named {key!r} already exists with other content ({dest}); "
                          f"rename the file to add it as a new partition")
        if reason is not None:
            scan.rejected[str(_reject(path, rejected, reason))] = reason
            continue
        store.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), str(store / path.name))
        scan.accepted[key] = digest
    return scan


def _reject(path: Path, folder: Path, reason: str) -> Path:
    """Move the file aside with its reason; never overwrite an earlier rejection."""
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / path.name
    if dest.exists():
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        dest = folder / f"{path.stem}.{stamp}{path.suffix}"
    shutil.move(str(path), str(dest))
    dest.with_name(dest.name + ".reason.txt").write_text(reason + "\n")
    return dest


@sensor(job=run_query_set, minimum_interval_seconds=10, default_status=DefaultSensorStatus.RUNNING,
        description="Adds a partition and starts a run for each valid query-set file dropped into the inbox; "
                    "moves invalid files to the rejected folder with the reason beside them.")
def query_set_inbox(context: SensorEvaluationContext, query_files: QueryFilesResource) -> SensorResult:
    known = set(context.instance.get_dynamic_partitions(query_sets.name))
    scan = scan_inbox(query_files, known)
    for path, reason in scan.rejected.items():
        context.log.warning(f"rejected {Path(path).name} (moved to {path}): {reason}")
    for key, digest in scan.accepted.items():
        context.log.info(f"query set {key}: added as a partition; requesting a run")
    if scan.waiting:
        context.log.info(f"{len(scan.waiting)} file(s) left for the next tick (still being written, or over the "
                         f"per-tick limit of {query_files.max_files_per_tick})")
    new_keys = [k for k in scan.accepted if k not in known]
    return SensorResult(
        run_requests=[RunRequest(run_key=f"{key}:{digest[:16]}", partition_key=key,
                                 tags={"conductor/trigger": "inbox"})
                      for key, digest in scan.accepted.items()],
        dynamic_partitions_requests=[query_sets.build_add_request(new_keys)] if new_keys else [],
    )


def fail_dead_runs(instance) -> list[str]:
    """Fail the STARTED runs whose worker process (the one that started the run) is gone: with
    `dagster dev` killed, its runs' workers die with it and nothing else ever ends those runs.
    They stayed STARTED for good, never retried, each holding one of the instance's concurrent
    runs, until the queue stopped. Only for a local (SQLite) instance, whose pids are this machine's."""
    if not is_local(instance):
        return []
    failed = []
    for run in instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED])):
        records = instance.get_records_for_run(run.run_id, of_type=DagsterEventType.RUN_START).records
        pids = [r.event_log_entry.dagster_event.pid for r in records if r.event_log_entry.dagster_event]
        if pids and pids[0] and process_gone(pids[0]):
            instance.report_run_failed(run, f"the run's worker process {pids[0]} is gone (dagster dev or the "
                                            f"machine stopped while it ran): failed so that run retries resume it "
                                            f"from its journal")
            failed.append(run.run_id)
    return failed


@sensor(minimum_interval_seconds=30, default_status=DefaultSensorStatus.RUNNING,
        description="Fails runs left STARTED by a worker process that is gone (dagster dev killed mid-run), so "
                    "that the instance's run retries resume them and they stop holding a concurrent-run slot.")
def dead_runs(context: SensorEvaluationContext) -> SkipReason:
    failed = fail_dead_runs(context.instance)
    for run_id in failed:
        context.log.warning(f"failed run {run_id}: its worker process is gone")
    return SkipReason(f"failed {len(failed)} run(s) whose worker was gone: {', '.join(failed)}" if failed
                      else "every STARTED run's worker is alive")
