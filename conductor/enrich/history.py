"""Earlier runs of a job: the records a rerun may reuse, and an interrupted run the
same command resumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from conductor.enrich.job import Job
from conductor.errors import ConductorError
from conductor.store import RunDir, damage_advice, file_damage, load_manifest

OK = "ok"  # a valid record
ABANDONED = "abandoned"  # an interrupted run a later run of other rows superseded


def interrupted_run(data_dir: Path, info: dict[str, Any], todo: list[str], pool: Any = None) -> str | None:
    """The newest run of this job that stopped before writing its records and was computing
    exactly these rows with the same definition: rerunning the command resumes it, so
    nothing is planned or paid twice. With `pool`, also with the same pool as the runner
    fingerprints it (every worker's identity, and what planners read): a direct-mode job's
    definition holds its own worker only, and the runner refused to resume under a pool edited
    elsewhere ("already exists with other inputs or settings"), where a new run, which closes this
    one as abandoned and gets its answers from the response cache, goes on."""
    runs = Path(data_dir) / "runs"
    found = []
    same_pool = {} if pool is None else {"pool_identity": pool.identity_hash(), "pool_planning": pool.planning_hash()}
    for m in runs.glob("*/manifest.json") if runs.exists() else ():
        folder = m.parent
        if (folder / "records.parquet").exists() or not (folder / "queries.parquet").exists():
            continue
        manifest = _manifest(m)
        inputs = manifest.get("inputs") or {}
        if any(k in inputs and inputs[k] != v for k, v in same_pool.items()):
            continue
        if manifest.get("job") == info and manifest.get("status") != ABANDONED:
            found.append((manifest.get("created_at") or "", folder))
    for _, folder in sorted(found, reverse=True):
        ids = read_table(folder / "queries.parquet", columns=["query_id"]).column(0).to_pylist()
        if ids == todo:
            return folder.name
    return None


def read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    """Those of `columns` (default: all) that a table of an earlier run has (its records, its
    query set), or a clear error naming the file and what to do, as `conductor sql` gives for it:
    a damaged one ended `job run` in a pyarrow traceback. Skipping it could pay again, unseen,
    for the rows it holds."""
    try:
        if columns is not None:
            have = pq.read_schema(path).names
            columns = [c for c in columns if c in have]
        return pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException) as e:
        why = file_damage(path) or (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        raise ConductorError(f"{path} is damaged ({why}); {damage_advice(path)}") from None


def _manifest(path: Path) -> dict[str, Any]:
    """A run's manifest, or a clear error: skipping a damaged one could miss the run to resume or
    the records to reuse, and pay for those rows again without a word."""
    try:
        return load_manifest(path)
    except ValueError as e:
        raise ConductorError(f"{path} is damaged ({e}); {damage_advice(path)}") from None


def abandon_interrupted(data_dir: Path, job_name: str, run_id: str) -> list[dict[str, Any]]:
    """Close the runs of this job that stopped before writing their records and that `run_id`
    does not resume (their rows or definition changed): they never would be. Each is marked
    `abandoned`, with what its journal says it paid, so that spend shows in the runs view, and so
    is its judge run if it was killed judging; the new run gets their answers from the response
    cache, at $0 there. A run that only judged (every row reused) has no query set: it is closed
    when its judge run was left unfinished."""
    from conductor.execute.journal import load_state

    runs = Path(data_dir) / "runs"
    closed = []
    for m in sorted(runs.glob("*/manifest.json")) if runs.exists() else ():
        folder = m.parent
        if folder.name == run_id or (folder / "records.parquet").exists():
            continue
        if not (folder / "queries.parquet").exists() and not (runs / f"{folder.name}-judge" / "manifest.json").exists():
            continue
        try:
            manifest = load_manifest(m)
        except ValueError:  # a damaged manifest is named by the catalog refresh, not here
            continue
        if (manifest.get("job") or {}).get("name") != job_name or manifest.get("status") == ABANDONED:
            continue
        state = load_state(folder / "work")
        lost = list(state.unsettled.values())  # sent when it was killed, answers never logged
        batches = _hand_over_batches(folder, Path(data_dir) / "runs" / run_id / "work")
        summary = {"job": job_name, "run_id": folder.name, "cost_usd": round(sum(state.spent.values()), 9),
                   "calls": len(state.paid), "superseded_by": run_id,
                   "lost_in_flight": {"calls": len(lost), "unpriced_calls": sum(u is None for _, _, u in lost),
                                      "reserved_usd": round(sum(u or 0.0 for _, _, u in lost), 9)},
                   "batches_in_flight": [b.get("batch_id") or b.get("input_file_id") for b in batches]}
        RunDir(data_dir, folder.name).set_status(ABANDONED, summary=summary)
        closed.append(summary)
        _abandon_judge_run(RunDir(data_dir, f"{folder.name}-judge"), job_name, run_id)
    return closed


def _abandon_judge_run(jrun: RunDir, job_name: str, run_id: str) -> None:
    """The judge run of an abandoned job run, if it was killed before it ended (no summary): marked
    `abandoned` with what its journal says it paid, as its job run is, so the `runs` view holds
    the judge's spend too."""
    from conductor.execute.journal import load_state

    if not jrun.exists():
        return
    try:
        manifest = jrun.read_manifest()
    except ConductorError:  # a damaged manifest is named by the catalog refresh, not here
        return
    if manifest.get("summary") is not None or manifest.get("status") == ABANDONED:
        return
    state = load_state(jrun.work)
    lost = list(state.unsettled.values())
    jrun.set_status(ABANDONED, summary={
        "job": job_name, "run_id": jrun.run_id, "judge_of": jrun.run_id.removesuffix("-judge"),
        "cost_usd": round(sum(state.spent.values()), 9), "calls": len(state.paid), "superseded_by": run_id,
        "lost_in_flight": {"calls": len(lost), "unpriced_calls": sum(u is None for _, _, u in lost),
                           "reserved_usd": round(sum(u or 0.0 for _, _, u in lost), 9)}})


def _hand_over_batches(folder: Path, new_work: Path) -> list[dict[str, Any]]:
    """Batches the killed run submitted (or uploaded) and never collected, journaled again in the
    new run's batch journal: the provider runs and bills them, so the new run polls them for the
    rows it asks again (the same requests) instead of paying for those rows a second time."""
    from conductor.errors import ConductorError
    from conductor.execute.batchfiles import BatchJournal

    try:
        journal = BatchJournal(folder / "work")
    except ConductorError:  # a damaged journal is named where a run reads it; closing goes on
        return []
    batches = [*journal.open.values(), *journal.uploaded.values()]
    if batches:
        new_work.mkdir(parents=True, exist_ok=True)
        mine = BatchJournal(new_work)
        try:
            for b in batches:
                mine.adopt(b, folder.name)
        finally:
            mine.close()
    return batches


INVALID = "invalid"  # a reply that is not a valid record, even after its repair


def invalid_before(data_dir: Path, job: Job, definition: str, exclude: str, hashes: dict[str, str]) -> set[str]:
    """Ids whose newest earlier record, for the same row, is `invalid` (a reply that failed the
    schema, even after its repair): asked again, not answered from the response cache, which holds
    the same bad answer. The executor bypasses the cache for the whole row (every step of its plan),
    so this is kept to those rows: a row a budget stopped (`budget_exhausted`) or whose step failed
    (`error`) has its answered steps in the cache, good ones, and its rerun pays only for the steps
    never answered (a planned row's extractors were paid again after a budget stop, audit60 F1)."""
    path = _newest_records(data_dir, job, definition, exclude)
    if path is None:
        return set()
    t = read_table(path, [job.id_column, "status", "row_hash"])  # three columns, not the records
    if job.id_column not in t.column_names:
        return set()
    t = t.filter(pc.equal(t.column("status"), INVALID))
    return {rid for r in t.select([job.id_column, "row_hash"]).to_pylist()
            if hashes.get(rid := str(r[job.id_column])) == r["row_hash"]}


def _newest_records(data_dir: Path, job: Job, definition: str, exclude: str) -> Path | None:
    runs = Path(data_dir) / "runs"
    found: list[tuple[str, str, Path]] = []
    for m in runs.glob("*/manifest.json") if runs.exists() else ():
        if m.parent.name == exclude or not (m.parent / "records.parquet").exists():
            continue
        manifest = _manifest(m)
        info = manifest.get("job") or {}
        if info.get("name") == job.name and info.get("definition") == definition:
            found.append((manifest.get("created_at") or "", m.parent.name, m.parent / "records.parquet"))
    return max(found)[2] if found else None


def previous_records(data_dir: Path, job: Job, definition: str, exclude: str) -> dict[str, dict[str, Any]]:
    """Newest valid record per id in the newest earlier run of this job with the same
    definition. Each run's records hold every row of its input (reused ones copied), so
    the newest run has every reusable record, and a daily job reads one file, not a year's."""
    newest = _newest_records(data_dir, job, definition, exclude)
    out: dict[str, dict[str, Any]] = {}
    best: dict[str, Any] = {}
    for path in [newest] if newest is not None else []:
        t = read_table(path)
        if job.id_column not in t.column_names:
            continue
        t = t.filter(pc.equal(t.column("status"), OK))
        names = [f.name for f in job.fields]
        for r in t.to_pylist():
            rid = str(r[job.id_column])
            if rid in best and best[rid] >= r["updated_at"]:
                continue
            best[rid] = r["updated_at"]
            out[rid] = {
                "row_hash": r["row_hash"], "status": r["status"], "error": r["error"], "run_id": r["run_id"],
                "record": {k: r[k] for k in names} if names else None, "text": r.get("text"),
                "confidence": {k: r.get(f"{k}_confidence") for k in names} if names else None,
                "judge_score": r.get("judge_score"), "judge_reason": r.get("judge_reason"),
                "judge_hash": r.get("judge_hash"),  # None before the column existed: judged again
            }
    return out
