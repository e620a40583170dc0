"""The four stages of a run (plan, execute, grade, report), each resumable.

The CLI, the Dagster assets and the benchmarks call these functions; none of
them holds logic of its own. A run's id defaults to a digest of what decides
its results (query file, pool workers, planner, samples, seed), so running the
same command again continues the same run instead of paying for it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from conductor import __version__, schemas
from conductor.errors import ConductorError, PlanError, StorageError
from conductor.execute.batch import online_fallback
from conductor.execute.budget import Ledger
from conductor.execute.cache import CacheDamaged
from conductor.execute.context import ExecutionContext, add_lost, lost_in_flight
from conductor.execute.engine import STORAGE_ERRORS, ExecOptions, PlanJob, WorkFolderGone
from conductor.execute.journal import STEPS_FILE, count_unanswered, load_state, unpriced_calls
from conductor.execute.shared import check_shared_urls
from conductor.execute.shared.cache import check_file_cache
from conductor.execute.prices import resolve_price
from conductor.execute.lock import run_lock
from conductor.execute.reserve import NoRoomForReserve, SpaceReserve, reserve_size
from conductor.failures import failed_plans, failure_groups, invalid_plan_groups, max_failed_share, too_many_failed
from conductor.grading import grade_all
from conductor.planners import make_planner
from conductor.planners.base import UNUSED_SLOT, Planner, PlannerBackEnd, Query
from conductor.planners.replan import BaseReplanner, make_replanner
from conductor.planparts import (FIRST_PART, next_size, part_path, ranges_to_plan, sound_parts, tiling,
                                 written_parts)
from conductor.plans import DEFAULT_MAX_STEPS, MAX_STEPS, Plan, parse_plan
from conductor.pool import Pool, load_pool
from conductor.preflight import plannable
from conductor.progress import Progress
from conductor.queries import carried_name, file_digest, input_columns, load_queries
from conductor.rewards import RewardScheme, group_advantages, score
from conductor.runids import (RUN_ID_RULE, earlier_digests, fingerprint_changes, id_options, options_outside_run_id,
                              run_id_stem, shown_options, valid_run_id, with_recorded_outside_options)
from conductor.runids import digest as run_digest
from conductor.store import (CatalogHeld, RunDir, check_data_dir, damage_advice, file_damage, finalize_journal,
                             refresh_catalog, rows_to_table, write_atomic, write_table)
from conductor.stats import run_totals
from conductor.yamlkeys import shown_value


@dataclass
class RunConfig:
    queries: Path
    pool: Path
    data_dir: Path = Path("data")
    run_id: str | None = None
    samples: int = 1
    planner: str = "embedded"
    planner_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    max_steps: int = DEFAULT_MAX_STEPS
    cache: bool = True
    cache_path: Path | None = None  # default: <data_dir>/cache.sqlite
    refresh: bool = False
    budget_usd: float | None = None  # per run, on top of the pool's per-provider budgets
    max_depth: int = 1  # re-planning levels: a planner step's sub-workflow is level 1
    plan_chunk: int = 50_000
    rewards: RewardScheme = field(default_factory=RewardScheme)
    progress: bool = True
    retry_failed: bool = False  # rerun every failed plan, not only those whose failure was transient
    store: str | None = None  # s3://bucket/prefix: the run is kept there too (conductor.execute.shared.objects)
    # `conductor run`'s --max-failed-share; None: $CONDUCTOR_MAX_FAILED_SHARE or 5%, as its default. The summary's
    # exit_code is decided by it, for every caller.
    max_failed_share: float | None = None
    # How the front end names a setting in the notes on a rerun that changed it (max_depth, budget_usd,
    # cost_penalty); unnamed ones get conductor run's flags (--max-depth, --budget, --cost-penalty).
    setting_names: dict[str, str] = field(default_factory=dict)


@dataclass
class Run:
    """A prepared run: validated inputs and the folder its outputs go to."""

    config: RunConfig
    pool: Pool
    queries: pa.Table
    dir: RunDir
    resumed: bool
    lease: Any = None  # with a store, the run's lease there (RunLease), held by run_all until the run ends
    # What this command's settings changed in a run it resumed (`--cost-penalty 100 (was 0)`), for the
    # caller to say: run_all returns them in the summary (`notes`), and `conductor run` prints them.
    notes: list[str] = field(default_factory=list)


# Every plan of a query is held in memory while it is planned and run: past this a typo
# (an extra zero or three) exhausts memory instead of being named.
MAX_SAMPLES = 4096


def prepare(cfg: RunConfig, pool: Pool | None = None, before_new: Callable[[], None] | None = None) -> Run:
    """Validate every input before anything is written; create or reopen the run. `pool`: the
    pool file as already loaded (run_all loads it first, to build the planner). `before_new`:
    checks that matter only to a run not begun yet (its planner's endpoint), run before its folder."""
    if not 1 <= cfg.samples <= MAX_SAMPLES:
        raise ConductorError(f"--samples is plans per query: 1 to {MAX_SAMPLES} (got {cfg.samples})")
    if not 1 <= cfg.max_steps <= MAX_STEPS:
        raise ConductorError(f"--max-steps must be from 1 to {MAX_STEPS} (got {cfg.max_steps})")
    if cfg.max_depth < 0:
        raise ConductorError(f"--max-depth must be at least 0 (got {cfg.max_depth})")
    if cfg.budget_usd is not None and not 0 <= cfg.budget_usd < math.inf:
        raise ConductorError(f"--budget is this run's USD cap: a finite number, at least 0 (got {cfg.budget_usd})")
    if not 0 <= cfg.rewards.cost_penalty < math.inf:
        raise ConductorError(f"--cost-penalty must be a finite number, at least 0 (got {cfg.rewards.cost_penalty})")
    reserve_size()  # environment settings read mid-run are checked before anything is paid for
    if cfg.store:
        from conductor.execute.shared.objects import sync_interval

        sync_interval()
    queries = load_queries(cfg.queries)
    pool = pool or load_pool(cfg.pool)
    if why := plannable(pool):  # a pool of function workers only: every plan would be invalid
        raise ConductorError(why)
    if unpriced := _unpriced_under_budget(pool, cfg.budget_usd is not None):
        # before the run folder: the price added is part of what the planner reads, so the fixed
        # command is a new run, and this one's plans would be left behind for nothing
        raise ConductorError("; ".join(unpriced) + " (nothing was written or sent)")
    fingerprint = {
        "queries_sha256": file_digest(cfg.queries),
        "pool_identity": pool.identity_hash(),
        "planner": cfg.planner, "planner_options": id_options(cfg.planner, cfg.planner_options),
        "samples": cfg.samples, "seed": cfg.seed, "max_steps": cfg.max_steps,
        "pool_planning": pool.planning_hash(),
    }
    digest, earlier = run_digest(fingerprint), earlier_digests(fingerprint, cfg.planner_options)
    stem = run_id_stem(Path(cfg.queries).stem)
    run_id = cfg.run_id or f"{stem}-{digest[:10]}"
    if not cfg.run_id and not RunDir(cfg.data_dir, run_id).exists():
        # A run begun by an earlier version, whose id covered less or more, resumes under its old id.
        for old in earlier:
            found = RunDir(cfg.data_dir, f"{stem}-{old[:10]}")
            if found.exists() and found.read_manifest().get("fingerprint") == old:
                run_id = found.run_id
                break
    if not valid_run_id(run_id):
        raise ConductorError(f"--run-id {run_id!r}: {RUN_ID_RULE}")
    check_data_dir(cfg.data_dir)
    run = RunDir(cfg.data_dir, run_id)
    lease = None
    if cfg.store:  # a run started elsewhere (a killed worker's) resumes here, unless it still runs there
        from conductor.execute.shared.objects import ObjectStore, RunLease

        store = ObjectStore(cfg.store)
        lease = RunLease(store, run_id).take()  # before the pull: a refused process fetches nothing
    try:
        if lease is not None:
            store.pull_run(run)
        if run.exists():
            manifest = run.read_manifest()
            if manifest.get("fingerprint") not in (digest, *earlier, *earlier_digests(
                    fingerprint, with_recorded_outside_options(cfg.planner, cfg.planner_options, manifest))):
                differs = fingerprint_changes(manifest.get("inputs") or {}, fingerprint, cfg.planner,
                                              cfg.planner_options)
                raise ConductorError(
                    f"run {run_id} already exists at {run.path} with other inputs or settings ({differs}); "
                    f"choose another --run-id (or omit it to get one derived from the inputs)")
            return Run(cfg, pool, queries, run, resumed=True, lease=lease)
        if before_new is not None:
            before_new()
        run.write_manifest({
            "run_id": run_id, "status": "created", "created_at": _now(), "fingerprint": digest,
            "conductor_version": __version__,
            "inputs": {"queries": str(Path(cfg.queries).resolve()), "pool": str(Path(cfg.pool).resolve()),
                       **fingerprint, "planner_options": shown_options(cfg.planner_options)},
            "settings": run_settings(cfg),
            PLANS_MAY_REPLAN: cfg.max_depth > 0,
        })
        return Run(cfg, pool, queries, run, resumed=False, lease=lease)
    except BaseException:
        if lease is not None:  # or the same command, rerun, would be refused until it lapses
            lease.release()
        raise


# The manifest's record of whether the run's own plans may give steps to planner workers (plans_may_replan).
PLANS_MAY_REPLAN = "plans_may_replan"


def plans_may_replan(run: Run) -> bool:
    """Whether the run's own plans may give steps to planner workers: not when the run was made with
    --max-depth 0 (a model planner leaves them out, top_level_kinds). Decided once, when the run is
    made: max_depth is outside the run id, and a rerun with another depth makes the plans left as the
    first were made (the planner's calls come from its run cache, not paid again). A run made before
    this was recorded planned with them, whatever its depth."""
    return run.dir.read_manifest().get(PLANS_MAY_REPLAN, True) is not False


def _note_planning_depth(run: Run, planner: Any) -> None:
    """Say when this command's --max-depth would have planned otherwise than the run decided when it
    was made (plans_may_replan), for a planner that may name the pool's planner workers."""
    ids = [w.id for w in run.pool.workers if w.kind == "planner"]
    kinds = getattr(getattr(planner, "config", None), "kinds", ())
    may, depth = plans_may_replan(run), run.config.max_depth
    if not ids or "planner" not in kinds or may == (depth > 0):
        return
    flag = run.config.setting_names.get("max_depth", EXECUTION_SETTINGS["max_depth"])
    new_run = "" if run.config.setting_names else " (--run-id NEW)"
    if may:
        run.notes.append(f"{flag} 0: the plans left to make may still give steps to the planner worker(s) "
                         f"{', '.join(ids)}, as the run's first plans could (it was made with re-planning "
                         f"allowed), and such steps fail at {flag} 0; a new run{new_run} plans without them")
    else:
        run.notes.append(f"{flag} {depth}: the plans left to make leave out the planner worker(s) "
                         f"{', '.join(ids)}, as the run's first plans did (it was made with {flag} 0); "
                         f"a new run{new_run} plans with them")


def outside_option_changes(run: Run) -> list[tuple[str, Any, Any]]:
    """The planner options outside the run id that this command gives otherwise than the run
    recorded them: (name, recorded, now), as the manifest shows values (None: not given)."""
    outside = options_outside_run_id(run.config.planner)
    recorded = (run.dir.read_manifest().get("inputs") or {}).get("planner_options") or {}
    now = shown_options({k: v for k, v in run.config.planner_options.items() if k in outside})
    return [(k, recorded.get(k), now.get(k)) for k in outside if recorded.get(k) != now.get(k)]


def _option_with(name: str, value: Any) -> str:
    """`--planner-option api_key_env=NAME`, or `no --planner-option api_key_env`."""
    if value is None:
        return f"no --planner-option {name}"
    return f"--planner-option {name}={str(value).lower() if isinstance(value, bool) else value}"


def _note_outside_options(run: Run, planning: bool) -> None:
    """Say what a changed option outside the run id did, and when `planning` (the plans made now
    use it) record it: the manifest's `inputs` show the options the plans were made with, and
    `settings_changed` each change. Planning done, it changed nothing but re-planning."""
    changes = outside_option_changes(run)
    if not changes:
        return
    replans = any(w.kind == "planner" for w in run.pool.workers)
    for name, old, new in changes:
        if planning:
            run.notes.append(f"{_option_with(name, new)} (was {_option_with(name, old)}) "
                             f"applies to the planning left; it never changes a plan, so the run keeps its id")
        elif replans:
            run.notes.append(f"{_option_with(name, new)} applies only to re-planning steps still to run: every "
                             f"plan had already been made, with {_option_with(name, old)}")
        else:
            run.notes.append(f"{_option_with(name, new)} changed nothing: every plan had already been made, "
                             f"with {_option_with(name, old)} (it never changes a plan)")
    if not planning:
        return
    manifest = run.dir.read_manifest()
    inputs = dict(manifest.get("inputs") or {})
    changed = {n for n, _, _ in changes}
    options = {k: v for k, v in (inputs.get("planner_options") or {}).items() if k not in changed}
    options.update({n: new for n, _, new in changes if new is not None})
    history = list(manifest.get("settings_changed") or [])
    history += [{"at": _now(), "setting": f"planner_options.{n}", "from": old, "to": new} for n, old, new in changes]
    run.dir.update(inputs={**inputs, "planner_options": options}, settings_changed=history)


def run_settings(cfg: RunConfig) -> dict[str, Any]:
    """Settings that shape a run's outputs without being part of its id (a rerun with another
    value resumes the same run): kept under `settings` in its manifest and summary, with a note
    when a rerun changes one. max_depth and budget_usd apply to the plans executed (re-planning
    depth, budget stops); cost_penalty to every reward, each time the run is graded."""
    return {"max_depth": cfg.max_depth, "budget_usd": cfg.budget_usd, "cost_penalty": cfg.rewards.cost_penalty}


EXECUTION_SETTINGS = {"max_depth": "--max-depth", "budget_usd": "--budget"}
GRADING_SETTINGS = {"cost_penalty": "--cost-penalty"}


def _shown_setting(value: Any) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _with(flag: str, value: Any) -> str:
    """`--budget 5`, or `no --budget` for a setting left unset."""
    return f"no {flag}" if value is None else f"{flag} {_shown_setting(value)}"


def _changed_settings(run: Run, manifest: dict[str, Any], names: dict[str, str], applied: bool,
                      how: Callable[[str, Any, Any], str]) -> dict[str, Any]:
    """Compare this command's settings `names` with those the run recorded. `applied`: they shape
    what this command writes (then recorded, and each change kept under `settings_changed`), else
    the run keeps its own. Notes go to run.notes, worded by `how(flag, new, old)`; returns the
    manifest keys to write (none when nothing changed)."""
    recorded = manifest.get("settings") or {}
    now = {k: v for k, v in run_settings(run.config).items() if k in names}
    # a key the run does not record (made before settings were): recorded once applied, with no note
    unknown = {k: v for k, v in now.items() if k not in recorded}
    changed = {k: v for k, v in now.items() if k in recorded and recorded[k] != v}
    for k, v in changed.items():
        run.notes.append(how(run.config.setting_names.get(k, names[k]), v, recorded[k]))
    if not applied or not (changed or unknown):
        return {}
    history = list(manifest.get("settings_changed") or [])
    history += [{"at": _now(), "setting": k, "from": recorded[k], "to": v} for k, v in changed.items()]
    return {"settings": {**recorded, **unknown, **changed}, **({"settings_changed": history} if changed else {})}


# ---- plan -------------------------------------------------------------------

def plan_stage(run: Run, planner: Planner | None = None, checked: bool = False) -> Path:
    """Write plans.parquet: K drafts per query, parsed and validated. Reused if present. A planner
    that plans at a cost checks the workers first (check_before_planning), here and not in run_all
    only: Dagster's `plans` asset and `job run` paid for planning, then failed on an unset key.
    `checked`: they were, before the run folder (run_all's new run)."""
    out = run.dir.table("plans")
    cfg = run.config
    failed: dict[str, int] = {}
    if out.exists():
        check_readable(out)
        failed = _failed_planning(out) if cfg.retry_failed else {}
        if not failed:
            _note_outside_options(run, planning=False)
            return out
    own = planner is None
    planner = planner or configured_planner(cfg)
    try:
        if not checked:  # a new run's planning, or --retry-failed's planning again
            check_before_planning(run.pool, planner, run)
        with run_lock(run.dir.work, run.dir.run_id), noting_stop(run.dir, "planning", lambda: spend_so_far(run)), \
                _named_storage_errors(run):
            _note_outside_options(run, planning=True)
            _note_planning_depth(run, planner)
            return _replan(run, planner, out, failed) if failed else _plan(run, planner, out)
    finally:
        if own:
            close_planner(planner)


def configured_planner(cfg: RunConfig, pool: Pool | None = None) -> Planner:
    """The planner the configuration names; model planners get the run's max_steps (another
    `max_steps` option is refused), the embedded and vLLM planners the run's seed unless the
    `seed` option is given (as bind does; here it also reaches a resumed execution's re-planner).
    Given the pool, the planner's worker is found in it, as `job check` does (enrich.job): a
    planner worker missing, of another kind, or an implicit one its options cannot make is
    refused before the run folder is written; so is a setting planning would refuse for the
    run's queries and samples (`check_samples`: the embedded planner's sweep short of samples)."""
    options = dict(cfg.planner_options)
    if cfg.planner in ("vllm", "llm"):
        options.setdefault("max_steps", cfg.max_steps)
    if cfg.planner in ("embedded", "vllm") and options.get("seed") is None:
        options["seed"] = cfg.seed
    planner = make_planner(cfg.planner, **options)  # a value out of the planner's range is said first
    try:
        if cfg.planner in ("vllm", "llm"):
            check_max_steps_option(cfg.planner_options, cfg.max_steps)
        if pool is not None and hasattr(planner, "resolve"):
            planner.resolve(pool)
            if hasattr(planner, "check_samples"):
                planner.check_samples(cfg.queries, planning_pool(pool), cfg.samples)
        check_no_replanning(cfg, planner, pool)
    except BaseException:
        close_planner(planner)
        raise
    return planner


def check_max_steps_option(options: dict[str, Any], max_steps: int) -> None:
    """Refuse a `max_steps` planner option other than --max-steps: the planner's prompt and schema
    allowed that many steps while plans are validated against --max-steps, so longer plans were
    paid for, then thrown away as invalid."""
    given = options.get("max_steps")
    if "max_steps" in options and (isinstance(given, bool) or given != max_steps):
        raise ConductorError(f"--planner-option max_steps={shown_value(given)} differs from --max-steps {max_steps}, "
                             f"against which plans are checked; give the number of steps with --max-steps "
                             f"(and drop the planner option)")


def check_no_replanning(cfg: RunConfig, planner: Any, pool: Pool | None) -> None:
    """Refuse --max-depth 0 with planner options that need a planner worker: a model planner's
    `kinds` with no llm (planner workers are left out of its plans, top_level_kinds, so no plan
    could begin), or an embedded `action=` that gives a step to one (the executor would refuse
    that step after the plan's earlier steps were paid for). Before the run folder is written."""
    if cfg.max_depth != 0:
        return
    kinds = getattr(getattr(planner, "config", None), "kinds", None)
    if kinds is not None and "llm" not in kinds:
        raise ConductorError(f"--max-depth 0 allows no re-planning, so plans leave out planner workers, and "
                             f"--planner-option kinds={','.join(kinds)} leaves no other kind a plan can begin "
                             f"with; add llm to kinds, or give --max-depth 1")
    named = planner.action_workers() if pool is not None and hasattr(planner, "action_workers") else ()
    if replanning := [w for w in named if pool.has(w) and pool.worker(w).kind == "planner"]:
        raise ConductorError(f"--max-depth 0 allows no re-planning, but --planner-option action gives a step to "
                             f"the planner worker(s) {', '.join(replanning)}, which re-plan; choose an action "
                             f"without them, or give --max-depth 1")


def planning_dir(run: Run) -> Path:
    """Journal and run cache of a planner that calls models through the executor."""
    return run.dir.work / "planner"


def planning_spent(run: Run) -> tuple[dict[str, float], dict[str, Any]]:
    """What planning spent, per provider, for the budgets of the execution: its logged calls,
    and at their worst case those it sent and never saw answered (cut off by timeout_s, or
    in flight when a planning process was killed), which the provider may have billed; and
    those calls, to be counted in the run's lost-in-flight line."""
    spent: dict[str, float] = {}
    lost = lost_in_flight({})
    if planning_dir(run).exists():
        add_journal_spend(planning_dir(run), spent, lost)
    return spent, lost


def add_journal_spend(work: Path, spent: dict[str, float], lost: dict[str, Any]) -> None:
    """Add a journal's logged calls to `spent` (per provider), and those sent and never seen
    answered at their worst case, counting them in `lost` too."""
    state = load_state(work)
    for pid, usd in state.spent.items():
        spent[pid] = spent.get(pid, 0.0) + usd
    for _, pid, usd in state.unsettled.values():
        count_unanswered(lost, usd)
        if usd is not None:
            spent[pid] = spent.get(pid, 0.0) + usd


def bind_planner(run: Run, planner: Any) -> None:
    """Give a planner back end the run's context (see PlannerBackEnd.bind)."""
    if isinstance(planner, PlannerBackEnd):
        cfg = run.config
        planner.bind(work_dir=planning_dir(run), cache_path=_cache_path(cfg) if cfg.cache else None,
             run_id=run.dir.run_id, seed=cfg.seed, refresh=cfg.refresh, budget_usd=cfg.budget_usd,
             progress=cfg.progress, retry_failed=cfg.retry_failed, replans=plans_may_replan(run))


def close_planner(planner: Any) -> None:
    """Free what a planner holds (a vLLM engine and its worker processes)."""
    if isinstance(planner, PlannerBackEnd):
        planner.close()


def _cache_path(cfg: RunConfig) -> Path:
    return cfg.cache_path or Path(cfg.data_dir) / "cache.sqlite"


def planning_pool(pool: Pool) -> Pool:
    """The pool as planners and the policy see it: a replay pool carries the questions its
    server can answer (Pool.recorded), so neither has to read the replay tables."""
    if pool.replay is None:
        return pool
    from conductor.replay.tables import with_recorded

    return with_recorded(pool)


def _plan(run: Run, planner: Planner, out: Path) -> Path:
    cfg = run.config
    bind_planner(run, planner)
    pool = planning_pool(run.pool)
    set_stage(run.dir, "planning")
    n = run.queries.num_rows
    folder = run.dir.work / "plan_parts"
    # A model planner may load an engine and generate for minutes with no counter: say what it does.
    progress = Progress(label="plan", enabled=cfg.progress)
    written = sound_parts(written_parts(folder, n, cfg.plan_chunk), run.dir.run_id, cfg.samples,
                          run.queries.column("query_id"), progress.say)
    size = min(FIRST_PART, cfg.plan_chunk)
    for lo, hi in ranges_to_plan(written, n):
        start = lo
        while start < hi:
            end = min(start + size, hi)
            t0 = time.monotonic()
            progress.say(f"planning queries {start + 1:,}-{end:,} of {n:,} x {cfg.samples} "
                         f"with the {planner.name} planner")
            path = part_path(folder, start, end)
            _plan_part(run, planner, pool, start, end, path)
            written[start] = (end, path)
            size = next_size(size, end - start, time.monotonic() - t0, cfg.plan_chunk)
            start = end
    table = pa.concat_tables([pq.read_table(p) for p in tiling(written, n, folder)]) \
        if n else schemas.PLANS.empty_table()
    write_table(out, table)
    run.dir.set_status("planned")
    return out


def _plan_part(run: Run, planner: Planner, pool: Pool, start: int, end: int, path: Path) -> None:
    rows = run.queries.slice(start, end - start).to_pylist()
    queries = [Query(index=start + i, **row) for i, row in enumerate(rows)]
    drafts = planner.plan(queries, pool, run.config.samples)
    if len(drafts) != len(queries) or any(len(d) != run.config.samples for d in drafts):
        raise ConductorError(f"planner {planner.name} returned the wrong number of plans")
    write_table(path, rows_to_table(_plan_rows(run, planner.name, queries, drafts), schemas.PLANS))


PLANNING_FAILED = "planning call failed"  # how the LLM planner's invalid plans begin when its call failed


def _failed_planning(plans: Path) -> dict[str, int]:
    """Plans whose planning call failed (plan id -> query index): `--retry-failed` asks again."""
    t = pq.read_table(plans, columns=["plan_id", "query_index", "valid", "error"])
    mask = pc.and_(pc.invert(t.column("valid")),
                   pc.fill_null(pc.starts_with(t.column("error"), PLANNING_FAILED), False))
    kept = t.filter(mask)
    return dict(zip(kept.column("plan_id").to_pylist(), kept.column("query_index").to_pylist()))


def _replan(run: Run, planner: Planner, out: Path, failed: dict[str, int]) -> Path:
    """Ask the planner again for the queries of plans whose planning call failed, and put their
    new plans in place of those; every other plan stays as it was (it may have run). Planning
    calls that succeeded before come from the planner's run cache, not the provider. The
    execution then runs a plan that became valid (journal: ResumeState.invalid)."""
    bind_planner(run, planner)
    indices = sorted(set(failed.values()))
    rows = run.queries.take(indices).to_pylist()
    queries = [Query(index=i, **row) for i, row in zip(indices, rows)]
    drafts = planner.plan(queries, planning_pool(run.pool), run.config.samples)
    fresh = [r for r in _plan_rows(run, planner.name, queries, drafts) if r["plan_id"] in failed]
    table = pq.read_table(out)
    kept = table.filter(pc.invert(pc.is_in(table.column("plan_id"), pa.array(list(failed), pa.string()))))
    merged = pa.concat_tables([kept, rows_to_table(fresh, schemas.PLANS).cast(kept.schema)])
    write_table(out, merged.sort_by([("query_index", "ascending"), ("sample", "ascending")]))
    return out


def _plan_rows(run: Run, planner_name: str, queries: list[Query], drafts) -> list[dict[str, Any]]:
    rows = []
    for q, ds in zip(queries, drafts):
        for k, d in enumerate(ds):
            plan, error = None, d.info.get("error") if not d.text else None
            if error is None:
                try:
                    plan = parse_plan(d.text, run.pool, run.config.max_steps)
                except PlanError as e:
                    error = str(e)
                    if d.info.get("truncated"):
                        cut = d.info.get("cut_by") or f"max_tokens={d.info.get('max_tokens')}"
                        error += f" (the planner's answer was cut off at {cut})"
            rows.append({
                "run_id": run.dir.run_id, "plan_id": f"{q.query_id}#{k}", "query_id": q.query_id,
                "query_index": q.index, "sample": k, "task": q.task, "planner": planner_name,
                "template_version": d.template_version, "planner_prompt": d.prompt, "raw_text": d.text,
                "valid": plan is not None, "error": error,
                "steps_json": plan.to_json() if plan else None,
                "n_steps": len(plan.steps) if plan else None,
                "workers": plan.workers if plan else None,
                "prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
                "logprob": d.logprob, "propensity": d.propensity,
                "info_json": orjson.dumps(d.info, default=str).decode() if d.info else None,
            })
    return rows


# ---- execute ----------------------------------------------------------------

def execute_stage(run: Run, **kw: Any) -> Path:
    """`_execute_stage` holding the run's lock: a second process on the same run refuses."""
    with run_lock(run.dir.work, run.dir.run_id), noting_stop(run.dir, "executing", lambda: spend_so_far(run)):
        return _execute_stage(run, **kw)


INTERRUPTED = "interrupted"
FAILED = "failed"
# What a stage stopped by an error keeps in the manifest besides `status: failed` (and spend, lost_in_flight);
# removed when a later command starts the stage again, or the run reaches its summary.
FAILURE_KEYS = ("failed_in", "failed_at", "error")
# The manifest's time of the commands interrupted since the last summary: the next summary adds it to its wall_time_s.
INTERRUPTED_TIME = "interrupted_wall_time_s"


def is_interrupt(e: BaseException) -> bool:
    """KeyboardInterrupt (SIGTERM takes Ctrl-C's path), DuckDB's own for Ctrl-C, Dagster's Terminate."""
    return (isinstance(e, KeyboardInterrupt) or type(e).__name__ in ("InterruptException",
                                                                   "DagsterExecutionInterruptedError")
            or str(e).startswith("Query interrupted"))


@contextlib.contextmanager
def noting_stop(run_dir: RunDir, stage: str | None = None,
                spent: Callable[[], tuple[list[dict], dict[str, Any]]] | None = None) -> Iterator[None]:
    """A stage that stops early says so in the manifest: it stayed `planning` or `executing` for
    good, like a live run. Ctrl-C or SIGTERM marks the run `interrupted`; an error (a rejected
    planner key, a damaged cache, a full disk) marks it `failed`, with the stage, the time and the
    error, but only when this command got `stage` under way (the manifest says `stage`): a refusal
    before it (a run locked by another process, a preflight) leaves the status as it was. The same
    command resumes the run and sets its status again. `spent`: what the run has paid so far and
    its calls lost in flight (spend_so_far), kept as a finished run keeps them (`spend`,
    `lost_in_flight`): a stopped run has no summary, and what it paid was in its journal alone."""
    try:
        yield
    except BaseException as e:
        if is_interrupt(e) and run_dir.exists():
            with contextlib.suppress(Exception):
                run_dir.set_status(INTERRUPTED)  # first: a second Ctrl-C below still leaves this
            if spent is not None:
                with contextlib.suppress(Exception):
                    spend, lost = spent()
                    run_dir.set_status(INTERRUPTED, spend=spend, lost_in_flight=lost, interrupted_at=_now())
        elif stage is not None and isinstance(e, Exception):
            with contextlib.suppress(Exception):
                if run_dir.read_manifest().get("status") == stage:
                    extra: dict[str, Any] = {"failed_in": stage, "failed_at": _now(), "error": failure_text(e)}
                    if spent is not None:
                        with contextlib.suppress(Exception):
                            extra["spend"], extra["lost_in_flight"] = spent()
                    run_dir.set_status(FAILED, **extra)
        raise


def failure_text(e: BaseException) -> str:
    """The error as the manifest keeps it: a ConductorError's message (already masked), else the
    exception's type and text, masked: never a key."""
    if isinstance(e, ConductorError):
        return str(e)
    from conductor.masking import mask

    return mask(f"{type(e).__name__}: {e}")


def set_stage(run_dir: RunDir, status: str, **extra: Any) -> None:
    """Set the run's status as a stage starts, dropping what an earlier failed command left."""
    run_dir.set_status(status, drop=FAILURE_KEYS, **extra)


@contextlib.contextmanager
def _named_storage_errors(run: Run) -> Iterator[None]:
    """A database error in planning (an LLM planner's cache or journal) is a storage error, as in
    execution: it ended the command in a traceback. A damaged cache is named (execute.cache)."""
    try:
        yield
    except sqlite3.DatabaseError as e:
        raise storage_error(e, run.dir.path) from None


def spend_so_far(run: Run) -> tuple[list[dict], dict[str, Any]]:
    """What the run has paid so far under each budget cap, and its calls lost in flight, as its
    journals say and as the resume will count them: planning's and the execution's calls logged,
    and at their worst case those sent and never settled (in flight when the run stopped)."""
    spent, lost = planning_spent(run)
    add_spend(spent, deleted_work_spend(run))
    if (run.dir.work / STEPS_FILE).exists():
        add_journal_spend(run.dir.work, spent, lost)
    ledger = Ledger({pid: p.budget_usd for pid, p in run.pool.providers.items()}, run.config.budget_usd, spent)
    return ledger.summary(), lost


# The manifest's record of what the run paid, per provider, in commands whose work folder (the journal)
# was deleted mid-run: in no journal, it counts in every later command's budgets and spend. Without it,
# a rerun served from the shared cache for $0 left that money in no run's spent_usd.
DELETED_WORK_SPEND = "spend_of_deleted_work"


def deleted_work_spend(run: Run) -> dict[str, float]:
    return run.dir.read_manifest().get(DELETED_WORK_SPEND) or {}


def add_spend(spent: dict[str, float], more: dict[str, float]) -> None:
    for pid, usd in more.items():
        spent[pid] = spent.get(pid, 0.0) + usd


def _keep_spend_of_deleted_work(run: Run, context: ExecutionContext, lost: dict[str, Any], error: str) -> None:
    """The work folder went while the run executed, its journal with it: the run is `failed`, and what
    it has paid (the journal's, planning's, this command's: the executor's ledger) stays in its
    manifest, for the rerun to count (DELETED_WORK_SPEND). The whole run folder gone too, there
    is no manifest to keep it in: the error says what happened all the same."""
    with contextlib.suppress(OSError, ConductorError):
        run.dir.set_status(FAILED, failed_in="executing", failed_at=_now(), error=error, spend=context.spend(),
                           lost_in_flight=add_lost(context.lost_in_flight, lost),
                           **{DELETED_WORK_SPEND: context.executor.ledger.spent_by_provider()})


def _check_work_kept(run: Run, context: ExecutionContext, lost: dict[str, Any]) -> None:
    """check_work, keeping what the run paid when the work folder is gone."""
    try:
        check_work(run)
    except ConductorError as e:
        _keep_spend_of_deleted_work(run, context, lost, str(e))
        raise


def _execute_stage(run: Run, *, replanner=None, progress: Progress | None = None,
                   planner: Planner | None = None, record=None, refresh: frozenset[str] = frozenset()) -> Path:
    """Run every plan not yet finished; then write traces.parquet and results.parquet.

    Steps assigned to a planner worker re-plan with `replanner`, else with the
    replanner of `planner` (the object that planned, to share a loaded engine),
    else with that of the configured planner. What planning already spent
    counts against the run's and the providers' budgets. `record` (a
    RecordSpec, enrichment jobs) makes every llm step answer with a record; the
    queries in `refresh` are asked again instead of answered by the shared cache."""
    cfg = run.config
    plans_path = run.dir.table("plans")
    check_shared_urls(run.pool, cache=False)  # the governor, as run_all checks it, for Dagster and job runs
    if journal_deleted(run):
        if cfg.retry_failed and _has_failed_plans(run):
            raise ConductorError(
                f"run {run.dir.run_id} is complete and its work folder {run.dir.work} (the journal of what was "
                f"done) was deleted, so its failed plans cannot be told apart to retry; start a new run with "
                f"another --run-id (answers in the shared response cache are not paid again)")
        check_readable(run.dir.table("traces"), run.dir.table("results"))
        return run.dir.table("results")
    state = load_state(run.dir.work, retry_failed=cfg.retry_failed)
    if state.invalid:  # invalid when they ran, valid now: planned again by --retry-failed
        state.finished -= state.invalid & _valid_plans(plans_path)
    total = pq.ParquetFile(plans_path).metadata.num_rows
    left = _plans_left(plans_path, state.finished)
    if left:  # with none left nothing is sent: a finished run's rerun needs no endpoint up (it regrades, reports)
        check_ready(run, plans_path)

    new_run = "" if cfg.setting_names else ": --run-id NEW"  # a front end naming its settings has no such flag

    def how(flag: str, new: Any, old: Any) -> str:
        if not left:
            return (f"{_with(flag, new)} changed nothing: every plan had already run, with {_with(flag, old)} "
                    f"(to run them with {_with(flag, new)}, start a new run{new_run})")
        before = (f"; the {total - left:,} finished before ran with {_with(flag, old)}" if total > left
                  else "; none had finished before")
        return f"{_with(flag, new)} (was {_with(flag, old)}) applies to the {left:,} plan(s) left to run{before}"

    manifest = run.dir.read_manifest()
    recorded = _changed_settings(run, manifest, EXECUTION_SETTINGS, bool(left), how)
    budget = cfg.budget_usd
    if not left:  # nothing runs: the spend lines keep the run's own cap, not one that changed nothing
        budget = (manifest.get("settings") or {}).get("budget_usd", budget)
    planning, planning_lost = planning_spent(run)
    add_spend(planning, deleted_work_spend(run))  # not in the journal: counted as planning's is
    own_planner = None
    if replanner is None and any(w.kind == "planner" for w in run.pool.workers):
        replanner = make_replanner(planner, run.pool, cfg.max_steps) if planner is not None else None
        if replanner is None:
            own_planner = configured_planner(cfg)
            replanner = make_replanner(own_planner, run.pool, cfg.max_steps)
    pool = replanner.extend_pool(run.pool) if isinstance(replanner, BaseReplanner) else run.pool
    progress = progress or Progress(enabled=cfg.progress)
    progress.c.plans_total = pq.ParquetFile(plans_path).metadata.num_rows
    progress.c.plans_done = progress.c.plans_resumed = len(state.finished)
    progress.c.started = time.monotonic()
    progress.c.usd = progress.c.usd_resumed = sum(state.spent.values())
    from conductor.functions import run_function

    reserve = executing = None
    try:
        reserve = SpaceReserve(run.dir.work) if left else None  # nothing runs: no answer needs the room
        context = ExecutionContext(
            run.dir.work, pool,
            ExecOptions(run_id=run.dir.run_id, refresh=cfg.refresh, run_budget_usd=budget, seed=cfg.seed),
            state=state, cache_path=_cache_path(cfg) if cfg.cache else None, progress=progress,
            spent_before=planning, functions=run_function, replanner=replanner, max_depth=cfg.max_depth,
            reserve=reserve, on_spend=lambda spend: run.dir.update(spend=spend))
        with context as executor:
            executing = True  # the journal exists from here on
            set_stage(run.dir, "executing", **recorded)
            asyncio.run(executor.run(_jobs(run, plans_path, record, refresh), state))
    except WorkFolderGone as e:  # seen mid-run: sending stopped
        _keep_spend_of_deleted_work(run, context, planning_lost, str(e))
        raise
    except STORAGE_ERRORS as e:
        if executing:
            _check_work_kept(run, context, planning_lost)
        error = storage_error(e, run.dir.path)
        if isinstance(e, NoRoomForReserve):  # before the stage began, so noting_stop leaves the status
            run.dir.set_status(FAILED, failed_in="executing", failed_at=_now(), error=str(error))
        raise error from None
    finally:
        if reserve is not None:
            reserve.release()
        if own_planner is not None:
            close_planner(own_planner)
    _check_work_kept(run, context, planning_lost)  # deleted after the executor's last look
    progress.say("writing traces and results")
    finalize_journal(run.dir)
    carry_columns(run)
    run.dir.set_status("executed", spend=context.spend(),
                       lost_in_flight=add_lost(context.lost_in_flight, planning_lost))
    return run.dir.table("results")


def _plans_left(plans_path: Path, finished: set[str]) -> int:
    """How many of the run's plans the journal does not show finished (to run now)."""
    left = 0
    for batch in pq.ParquetFile(plans_path).iter_batches(columns=["plan_id"], batch_size=65536):
        left += sum(1 for p in batch.column(0).to_pylist() if p not in finished)
    return left


def _valid_plans(plans_path: Path) -> set[str]:
    t = pq.read_table(plans_path, columns=["plan_id", "valid"])
    return set(t.filter(t.column("valid")).column("plan_id").to_pylist())


def _has_failed_plans(run: Run) -> bool:
    """Whether a finished run has anything for --retry-failed: a scheduler that always passes it
    must not fail a run that has none."""
    statuses = pq.read_table(run.dir.table("results"), columns=["status"]).column("status").to_pylist()
    return any(s != "ok" for s in statuses)


def journal_deleted(run: Run) -> bool:
    """A complete run whose work folder was deleted (the README allows it): its
    traces and results stand as they are, and nothing is executed again."""
    return (not (run.dir.work / STEPS_FILE).exists() and run.dir.table("results").exists()
            and run.dir.table("traces").exists() and run.dir.read_manifest().get("status") == "complete")


def carry_columns(run: Run) -> None:
    """Copy the query set's other columns (company, quarter, ...) into results.parquet,
    row by row (by query_index), so nothing the user supplied is dropped silently. A
    column whose name results already uses, in any case (SQL ignores it), is carried as
    `input_<name>`; load_queries refuses a file where that name is another of its columns."""
    extra = input_columns(run.config.queries)
    if extra is None:
        return
    path = run.dir.table("results")
    results = pq.read_table(path)
    taken = pc.take(extra, results.column("query_index"))
    for name in taken.column_names:
        results = results.append_column(carried_name(name), taken.column(name))
    write_table(path, results)


def check_readable(*paths: Path) -> None:
    """A run's table that a rerun does not write again must read (its footer): a damaged one
    ended the rerun in a pyarrow traceback."""
    for path in paths:
        why = file_damage(path)
        if why is not None:
            raise ConductorError(f"{path} is damaged ({why}); {damage_advice(path)}")


def check_work(run: Run) -> None:
    """A work folder deleted while the run executed took its journal with it: say so."""
    if not (run.dir.work / "steps.jsonl").exists():
        raise ConductorError(f"the run's work folder {run.dir.work} was deleted while the run was executing, and "
                             f"with it the record of what was done; rerun the same command to redo the run "
                             f"(answers in the shared response cache are not paid again)")


def storage_error(e: BaseException, where: Path) -> StorageError:
    """The message for a disk or database failure: what failed, and that a rerun loses nothing.
    A response cache found damaged mid-run names that file and what to do with it instead."""
    if isinstance(e, CacheDamaged):  # its message says what to do with the file
        return StorageError(f"stopped: {e}. The rerun resumes the run in {where}: answers it already paid for "
                            f"are kept and not paid again")
    if isinstance(e, NoRoomForReserve):
        return StorageError(f"stopped before execution sent any call: {e.strerror}; then rerun the same command")
    if isinstance(e, OSError) and e.strerror:
        what = e.strerror + (f": {e.filename}" if e.filename else "")
    else:
        what = f"{type(e).__name__}: {e}"
    return StorageError(f"stopped: cannot write under {where} ({what}). Free space (or fix the disk) and rerun "
                        f"the same command: answers already paid for are kept and not paid again")


def check_ready(run: Run, plans_path: Path) -> None:
    """Refuse to start, before any call, what would fail or overspend anyway."""
    used = set()
    for batch in pq.ParquetFile(plans_path).iter_batches(columns=["workers"], batch_size=65536):
        for ws in batch.column(0).to_pylist():
            used.update(ws or ())
    # an unpriced worker under a budget was refused by prepare, before the run folder
    if problems := worker_problems(run.pool, used):
        raise NotReady("cannot start executing (plans are saved; no worker was called): "
                       + "; ".join(p.text for p in problems), rerun_advice(run, problems, "planned"))


class NotReady(ConductorError):
    """A refusal before any call whose advice is about the run's folder: resume it, or delete it.
    `job run` deletes the folder of a run refused before any call, and takes `without_advice`:
    with the advice, it told the user to resume a run that no longer existed."""

    def __init__(self, text: str, advice: str):
        from conductor.masking import mask

        super().__init__(f"{text}. {advice}" if advice else text)
        self.without_advice = mask(f"{text}; fix this and rerun")


def worker_problems(pool: Pool, used: set[str]) -> list[Any]:
    """What would fail every call of the workers `used`: a provider's key variable unset, and
    the preflight's (conductor.preflight.Problem, each with what fixes it). Both at once: the
    variables alone hid an endpoint down or a model not served until the next attempt (an
    unset key takes nothing from the preflight: a /models that wants one is not judged)."""
    from conductor.preflight import Problem, problems_of

    problems = []
    for pid, provider in pool.providers.items():
        workers = [w for w in pool.workers if w.provider == pid and w.id in used]
        if workers and provider.api_key_env and not os.environ.get(provider.api_key_env):
            where = f" (pool file {pool.path})" if pool.path else ""
            problems.append(Problem(f"provider {pid}{where}: environment variable {provider.api_key_env} is not "
                                    f"set (needed by {', '.join(w.id for w in workers)})", "env"))
    return problems + problems_of(pool, used)


# What a fix does to the run's id (prepare's fingerprint: the pool's workers, their descriptions, skills and
# prices, and the planner options but those that never change a plan; not keys, nor providers' limits,
# budgets or api_key_env).
_SAME_RUN = {"env": "setting the variable", "server": "starting the server at that api_base",
             "served": "serving that model at that api_base"}
_NEW_RUN = {"server": "a changed api_base", "served": "a corrected model", "model": "a corrected model",
            "api_base": "a changed api_base"}


def rerun_advice(run: Run, problems: list[Any], status: str) -> str:
    """Whether the fix of `problems` resumes this run, or starts a new one that plans again (the
    run's id covers the pool file's workers): "fix this and rerun" let a user believe either."""
    kinds = list(dict.fromkeys(p.fix for p in problems))
    same = [_SAME_RUN[k] for k in kinds if k in _SAME_RUN]
    new = list(dict.fromkeys(_NEW_RUN[k] for k in kinds if k in _NEW_RUN))
    what = "resumes it with these plans" if status == "planned" else "resumes its planning"  # else not planned yet
    text = []
    if same:
        text.append(f"Fixed by {' or '.join(same)}, the same command {what} (run {run.dir.run_id})")
    if new:
        text.append(f"{(' or '.join(new)).capitalize() if not text else ' or '.join(new)} in the pool file starts a new run (the run id covers the "
                    f"pool file's workers and the planner options), which plans again; run {run.dir.run_id} then "
                    f"stays `{status}` and its folder {run.dir.path} can be deleted")
    return "; ".join(text)


def check_before_planning(pool: Pool, planner: Any, run: Run | None = None) -> None:
    """A planner whose planning costs money or time (an LLM's calls, a vLLM engine's start) checks
    every worker its plans may use (the pool's) first, as check_ready does after planning: a key
    variable unset or an endpoint down was found only after every planning call was paid for.
    `run`: the run resumed, whose planning is not done; None: a new run, before its folder."""
    if not getattr(planner, "plans_at_a_cost", False):
        return
    problems = worker_problems(pool, {w.id for w in pool.workers})
    if not problems:
        return
    listed = "; ".join(p.text for p in problems)
    if run is None:
        raise ConductorError(f"cannot start planning (nothing was written or called): {listed}; fix this and rerun")
    status = run.dir.read_manifest().get("status") or "planning"
    raise NotReady(f"cannot start planning (no call was made): {listed}", rerun_advice(run, problems, status))


def _unpriced_under_budget(pool: Pool, budget_on: bool) -> list[str]:
    """Providers under a budget with workers of no known price: never a silent $0."""
    problems = []
    for pid, provider in pool.providers.items():
        if provider.budget_usd is None and not budget_on:
            continue
        unpriced = [w.id for w in pool.workers if w.provider == pid and w.kind != "function" and w.model
                    and resolve_price(w) is None]
        if unpriced:
            problems.append(f"provider {pid}: no known price for worker(s) {', '.join(unpriced)}, so they cannot "
                            f"run under a budget; add price: {{input_per_mtok, output_per_mtok}} in the pool file")
    return problems


def _jobs(run: Run, plans_path: Path, record=None, refresh: frozenset[str] = frozenset()) -> Iterator[PlanJob]:
    prompts = run.queries.column("prompt")
    cols = ["plan_id", "query_id", "query_index", "sample", "task", "steps_json", "error"]
    for batch in pq.ParquetFile(plans_path).iter_batches(columns=cols, batch_size=4096):
        for r in batch.to_pylist():
            plan = Plan.from_json(r["steps_json"]) if r["steps_json"] else None
            yield PlanJob(r["plan_id"], r["query_id"], r["query_index"], r["sample"], r["task"],
                          prompts[r["query_index"]].as_py(), plan, r["error"], record,
                          refresh=r["query_id"] in refresh)


# ---- grade ------------------------------------------------------------------

def grade_stage(run: Run) -> Path:
    """Write rewards.parquet from results.parquet and the query set's references."""
    with noting_stop(run.dir):
        return _grade(run)


def _grade(run: Run) -> Path:
    cfg = run.config
    refs = run.queries.select(["query_id", "task", "reference"]).to_pylist()
    results = pq.read_table(run.dir.table("results"),
                            columns=["plan_id", "query_id", "query_index", "sample", "status",
                                     "final_answer", "cost_usd", "error"]).to_pylist()
    full = _full_costs(run) if cfg.rewards.cost_penalty else {}
    # Answers graded at once, so that code answers run their sandboxes side by side (grade_all).
    code = [(i, refs[r["query_index"]]) for i, r in enumerate(results)
            if r["status"] == "ok" and refs[r["query_index"]]["task"] == "code"]
    if code:
        Progress(label="grade", enabled=cfg.progress).say(f"running the tests of {len(code):,} code answers")
    graded = dict(zip((i for i, _ in code),
                      grade_all((q["task"], results[i]["final_answer"], q["reference"]) for i, q in code)))
    rows = []
    for i, r in enumerate(results):
        q = refs[r["query_index"]]  # results carry the query's row index
        cost = full.get(r["plan_id"], r["cost_usd"])
        if r["status"] == "invalid_plan" and (r["error"] or "").startswith(UNUSED_SLOT):
            s = {"answer": None, "parsed": None, "correct": None, "reward": None}
        else:
            s = score(r["status"], q["task"], q["reference"], r["final_answer"], cost, cfg.rewards, graded.get(i))
        rows.append({"run_id": run.dir.run_id, "plan_id": r["plan_id"], "query_id": r["query_id"],
                     "query_index": r["query_index"], "sample": r["sample"], "task": q["task"],
                     "status": r["status"], "reference": q["reference"], "cost_usd": r["cost_usd"], **s})
    _add_advantages(rows, cfg.rewards.eps)
    out = run.dir.table("rewards")
    manifest = run.dir.read_manifest()
    recorded = _changed_settings(run, manifest, GRADING_SETTINGS, True, lambda flag, new, old: (
        f"rewards regraded with {flag} {_shown_setting(new)} (was {_shown_setting(old)}): rewards.parquet, "
        f"advantage and mean_reward now use {_shown_setting(new)}"))
    unknown = "cost_penalty" not in (manifest.get("settings") or {})
    if unknown and cfg.rewards.cost_penalty != RewardScheme().cost_penalty:
        # made before settings were recorded: what it was graded with before is not known
        flag = cfg.setting_names.get("cost_penalty", GRADING_SETTINGS["cost_penalty"])
        run.notes.append(f"rewards regraded with {flag} {_shown_setting(cfg.rewards.cost_penalty)} (the "
                         f"penalty this run was graded with before is not recorded): rewards.parquet, advantage "
                         f"and mean_reward now use it")
    write_table(out, rows_to_table(rows, schemas.REWARDS))
    run.dir.set_status("graded", **recorded)
    return out


def _full_costs(run: Run) -> dict[str, float]:
    """What each plan's answers cost when first paid for: the cost penalty prices the
    workflow, not the cache's luck (a cache hit costs this run $0). Export and policy
    training price plans the same way."""
    traces = pq.read_table(run.dir.table("traces"), columns=["plan_id", "cost_usd", "original_cost_usd"])
    paid = pc.coalesce(traces.column("original_cost_usd"), traces.column("cost_usd"), pa.scalar(0.0))
    sums = pa.table({"plan_id": traces.column("plan_id"), "paid": paid}).group_by("plan_id").aggregate(
        [("paid", "sum")])
    return dict(zip(sums.column("plan_id").to_pylist(), sums.column("paid_sum").to_pylist()))


def _add_advantages(rows: list[dict[str, Any]], eps: float) -> None:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["query_id"], []).append(r)
    for group in groups.values():
        for r, a in zip(group, group_advantages([r["reward"] for r in group], eps)):
            r["advantage"] = a


# ---- report -----------------------------------------------------------------

def report_stage(run: Run, wall_time_s: float | None = None) -> dict[str, Any]:
    """Summarize the run, store the summary, and refresh the DuckDB catalog."""
    t = run_totals(run.dir.path)
    n_queries = run.queries.num_rows
    manifest = run.dir.read_manifest()
    before = manifest.get("summary") or {}
    if planning_dir(run).exists():
        planning = sum(load_state(planning_dir(run)).spent.values())  # LLM planners' own calls
        planning_unpriced = unpriced_calls(planning_dir(run))
    else:  # none, or the work folder was deleted after the run completed
        planning = before.get("planning_cost_usd") or 0.0
        planning_unpriced = before.get("planning_calls_without_price") or 0
    cost = t.cost_usd + planning
    statuses = t.statuses
    failed, total = failed_plans(statuses)
    threshold = run.config.max_failed_share
    if threshold is None:  # not `conductor run` (the demo, Dagster): the exit code it would give, by its default
        with contextlib.suppress(ConductorError):  # a bad $CONDUCTOR_MAX_FAILED_SHARE: `conductor run` refuses it
            threshold = max_failed_share()
    pending = manifest.get(INTERRUPTED_TIME) or 0.0
    if wall_time_s is not None:
        # every command that worked on the run: those that reached a summary, and those interrupted before
        wall_time_s = round((before.get("wall_time_s") or 0.0) + pending + wall_time_s, 3)
    settings = {**(manifest.get("settings") or {}), "max_failed_share": threshold}  # as the stages recorded them
    summary = {
        "run_id": run.dir.run_id,
        "queries": n_queries,
        "plans": t.plans,
        "valid_plans": t.valid_plans,
        "statuses": statuses,
        "calls": t.calls,
        "cache_hits": t.cache_hits,
        "graded": t.graded,
        "accuracy": t.accuracy,
        "mean_reward": t.mean_reward,
        "cost_usd": cost,
        "planning_cost_usd": planning,
        "planning_calls_without_price": planning_unpriced,
        "cost_per_query_usd": cost / n_queries if n_queries else None,
        "plans_without_price": t.plans_without_price,
        "tokens_per_query": t.tokens / n_queries if n_queries else None,
        "wall_time_s": wall_time_s,
        "spend": manifest.get("spend", []),
        "lost_in_flight": lost_in_flight(manifest),
        "batch_online": online_fallback(run.dir.table("traces")),
        "outputs": str(run.dir.path),
        "failures": failure_groups(run.dir.table("traces"), run.pool),
        "invalid_plans": invalid_plan_groups(run.dir.table("plans")),
        # A run whose plans mostly failed is `complete` all the same (no budget stopped it): these tell
        # it apart. exit_code is what `conductor run` exits with (for the demo and Dagster too, by its default
        # --max-failed-share: the README's filter of usable runs reads it).
        "failed_plans": failed,
        "failed_share": failed / total if total else None,
        "exit_code": None if threshold is None else exit_code(statuses, threshold),
        # what shaped the outputs besides the run's id: re-planning depth, run budget, cost penalty; and
        # the largest share of failed plans exit_code was decided by
        "settings": settings,
    }
    write_atomic(run.dir.path / "summary.json", orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    complete = "budget_exhausted" not in statuses
    manifest = run.dir.read_manifest()
    manifest.update(status="complete" if complete else "incomplete", summary=summary, settings=settings)
    if wall_time_s is not None:
        manifest.pop(INTERRUPTED_TIME, None)  # counted in wall_time_s now
    for key in ("interrupted_at", *FAILURE_KEYS):  # a failed command's error, resumed since
        manifest.pop(key, None)
    run.dir.write_manifest(manifest)
    summary["catalog"] = catalog_line(run.config.data_dir)
    return summary


def exit_code(statuses: dict[str, int], max_failed_share: float) -> int:
    """`conductor run`'s exit status for a run that finished: 4 when more than `max_failed_share`
    of its plans failed, 3 when a budget stopped some, else 0."""
    if too_many_failed(statuses, max_failed_share):
        return 4
    return 3 if statuses.get("budget_exhausted") else 0


def catalog_line(data_dir: str | Path) -> str:
    """Refresh the catalog for the summary's line; a catalog that cannot be refreshed does not
    fail a run whose outputs are complete: the line says why, and which damaged files it left out."""
    notes: list[str] = []
    try:
        return "; ".join([str(refresh_catalog(data_dir, attempts=4, warn=notes.append)), *notes])
    except CatalogHeld:
        return (f"not refreshed (another process holds {Path(data_dir) / 'conductor.duckdb'}); "
                f"`conductor sql` refreshes it when it is free")
    except ConductorError as e:
        return f"not refreshed: {e}"


def run_all(cfg: RunConfig, planner: Planner | None = None, replanner=None) -> dict[str, Any]:
    t0, started = time.monotonic(), _now()
    own = planner is None
    # Created here, not per stage, so that re-planning steps reuse it (a loaded
    # vLLM engine); and before the run folder, so that a bad setting writes nothing.
    pool = load_pool(cfg.pool)
    planner = planner or configured_planner(cfg, pool)
    check_shared_urls(pool, cache=cfg.cache)  # before the run folder: a wrong Redis password failed every plan
    if cfg.cache:
        check_file_cache(_cache_path(cfg), pool)
    from conductor.execute.shared.objects import store_url

    cfg.store = store_url(cfg.store)  # else CONDUCTOR_STORE (Dagster's assets share the data volume instead)

    def planner_ready() -> None:  # for a new run only: a resumed one may have all its plans
        if hasattr(planner, "ready"):
            planner.ready(pool, budget_usd=cfg.budget_usd)
        check_before_planning(pool, planner)

    run = prepare(cfg, pool, before_new=planner_ready)
    store = run.lease.store if run.lease is not None else None
    # The run's lease on the store is renewed while the run goes on and released when it ends, however it ends.
    with run.lease or contextlib.nullcontext(), _timing_interrupts(run, t0, started, store):
        if store is not None:
            store.push_run(run.dir)
        try:
            # With a store, plan parts and the journal go up as they are written.
            with _uploading(store, run):
                plan_stage(run, planner, checked=not run.resumed)  # a new run's workers: by planner_ready
                if own and (cfg.max_depth == 0 or not any(w.kind == "planner" for w in run.pool.workers)):
                    # Nothing re-plans (at depth 0 the executor refuses a planner step before it asks): free
                    # the engine now. Held through execution, a loaded vLLM engine outlived a kill -9 of this
                    # process in its own process (GPU memory held for good).
                    close_planner(planner)
                execute_stage(run, replanner=replanner, planner=planner)
        finally:
            if own:
                close_planner(planner)
        grade_stage(run)
        summary = report_stage(run, wall_time_s=round(time.monotonic() - t0, 3))
        if store is not None:
            store.push_run(run.dir)
    summary["resumed"] = run.resumed
    summary["notes"] = run.notes
    return summary


@contextlib.contextmanager
def _timing_interrupts(run: Run, t0: float, started: str, store=None) -> Iterator[None]:
    """A command interrupted in a stage (the run left `interrupted`), or stopped there by an error
    (left `failed` by this command, which began at `started`), keeps its time in the manifest, which
    the summary's wall_time_s adds: the resume that reached it reported its own seconds alone. With a
    store, its copy gets it too: the stage's last upload came before it."""
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(Exception):
            m = run.dir.read_manifest()
            if (m.get("status") == INTERRUPTED if is_interrupt(e)
                    else m.get("status") == FAILED and str(m.get("failed_at") or "") >= started):
                m[INTERRUPTED_TIME] = round((m.get(INTERRUPTED_TIME) or 0.0) + time.monotonic() - t0, 3)
                run.dir.write_manifest(m)
                # The whole push (it settles a journal deleted mid-run before the manifest), unless another
                # process took the run over: the store's objects are then its own.
                if store is not None and (run.lease is None or run.lease.lost is None):
                    store.push_run(run.dir)
        raise


def _uploading(store, run: Run):
    if store is None:
        return contextlib.nullcontext()
    from conductor.execute.shared.objects import JournalUploader

    return JournalUploader(store, run.dir, lease=run.lease)


def _now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat()
