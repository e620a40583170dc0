"""One Dagster concurrency pool per provider, so that parallel runs on one
instance cannot together exceed a provider's limits.

conductor enforces a provider's limits (rpm, tpm, max_concurrency, budget)
inside one process. Two runs executing at once would each enforce them alone and
together send twice the traffic. So a step that calls a provider (executing
plans, or planning with an LLM) first takes a slot in that provider's pool
(`provider-<id>`); with the instance's pool `default_limit: 1`
(data/dagster_home/dagster.yaml) one step per provider runs at a time, and its
in-process limiter is then the limit for the whole instance. With a shared
governor (conductor.execute.shared) that is no longer needed, and no provider pool is claimed.

A run calls every provider of its pool file from one step, and Dagster's
`pool=` gives an op only one pool. The LLM-calling steps therefore claim their
pools themselves, through the instance's concurrency storage (the same calls
Dagster's executor makes for `pool=`): one slot in each pool, in name order so
that two runs never wait on each other in a cycle, all freed when the step
ends (and by the daemon's run monitoring a minute after a run ends). A run
worker killed outright (kill -9) stays STARTED under the default run launcher,
so nothing would free its slots: a step waiting for a pool frees the slots of
a holder whose run has ended, or whose step's process is gone (SQLite
instance: one machine, so its process ids can be checked). The pools,
their limits and the steps holding them show on the UI's concurrency page; the
assets that claim pools carry the tag `conductor/pools: provider`.
"""

from __future__ import annotations

import fcntl
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from conductor.pool import Pool, provider_from_model
from conductor.store import process_gone

PROVIDER_PREFIX = "provider-"
PLANNER_PREFIX = "planner-"
POOLS_TAG = {"conductor/pools": "provider"}


def provider_pools(pool: Pool) -> list[str]:
    """The pools of every provider that serves a model in the pool file;
    function workers (vote, extract) run locally and need none. With a shared
    governor (a redis:// URL in the pool file or CONDUCTOR_GOVERNOR) the
    provider's limits and budget hold across every process by themselves: the
    steps claim no provider pool, and a backfill runs as many partitions at once
    as the run queue and executor allow, all drawing on the same limits."""
    from conductor.execute.shared import governor_url

    if not governor_url(pool.governor).startswith("memory://"):
        return []
    return sorted({PROVIDER_PREFIX + w.provider for w in pool.workers if w.kind != "function"})


def planner_pools(kind: str, options: dict, pool: Pool) -> list[str]:
    """The embedded planner calls nothing. An LLM planner calls a provider like
    the workers do, so it takes that provider's pool (the provider of its pool
    worker, or of its model: the `provider` option or the model string's
    prefix, as conductor.planners.llm resolves it). A vLLM planner holds the
    machine's accelerator: one engine at a time per instance."""
    if kind == "embedded":
        return []
    if kind == "llm":
        from conductor.execute.shared import governor_url

        if not governor_url(pool.governor).startswith("memory://"):
            return []  # the shared governor holds the provider's limits (see provider_pools)
        if options.get("worker") and pool.has(options["worker"]):
            return [PROVIDER_PREFIX + pool.worker(options["worker"]).provider]
        model = options.get("model") or ""
        return [PROVIDER_PREFIX + (options.get("provider") or provider_from_model(model))]
    return [PLANNER_PREFIX + kind]


@contextmanager
def hold_pools(context, pools: Iterable[str], poll_s: float = 1.0, log_every_s: float = 30.0) -> Iterator[list[str]]:
    """Hold one slot in each pool for the body of the `with`; yields the pools
    held. Pools without a limit (and no instance default) are not limited."""
    instance = context.instance
    storage = instance.event_log_storage
    names = sorted(set(pools))
    if not names or not storage.supports_global_concurrency_limits:
        yield []
        return
    run_id = context.run.run_id
    step_key = context.get_step_execution_context().step.key
    held: list[str] = []
    try:
        for name in names:
            with _claims_serialized(instance):
                limited = _limited(instance, name)
            if not limited:
                context.log.info(f"pool {name} has no limit; not waiting for it")
                continue
            start, last_log = time.monotonic(), None
            while True:
                with _claims_serialized(instance):
                    claimed = storage.claim_concurrency_slot(name, run_id, step_key).is_claimed
                if claimed:
                    break
                if last_log is None or time.monotonic() - last_log >= log_every_s:
                    last_log = time.monotonic()
                    if _free_dead_holders(context, name, run_id):
                        continue
                    holders = sorted({s.run_id for s in storage.get_concurrency_info(name).claimed_slots})
                    context.log.info(
                        f"waiting for a slot in pool {name}, held by run(s) {', '.join(holders) or '?'} "
                        f"({last_log - start:.0f} s so far). If such a run is no longer running, free its slots in "
                        f"the UI (the run's page: Terminate > Force termination immediately, or Deployment > "
                        f"Concurrency > {name}: Free all concurrency slots for run)")
                time.sleep(poll_s)
            held.append(name)
            context.log.info(f"holding a slot in pool {name}")
        yield held
    finally:
        # Frees this step's slots and any claim still waiting in a queue.
        with _claims_serialized(instance):
            storage.free_concurrency_slot_for_step(run_id, step_key)


def _free_dead_holders(context, name: str, own_run_id: str) -> list[str]:
    """Free the slots of the runs holding `name` that are no longer running; returns their ids.
    A holder that is not a run of this instance is left alone."""
    instance = context.instance
    dead = []
    for slot in instance.event_log_storage.get_concurrency_info(name).claimed_slots:
        run = instance.get_run_by_id(slot.run_id) if slot.run_id != own_run_id else None
        if run is not None and slot.run_id not in dead and (
                run.is_finished or (_is_sqlite(instance) and _step_process_gone(instance, slot.run_id, slot.step_key))):
            dead.append(slot.run_id)
    for holder in dead:
        with _claims_serialized(instance):
            instance.event_log_storage.free_concurrency_slots_for_run(holder)
        context.log.warning(f"freed the slots of run {holder} in pool {name} and its other pools: the run "
                            f"is no longer running (its worker process ended without freeing them)")
    return dead


def _step_process_gone(instance, run_id: str, step_key: str) -> bool:
    """Whether the process that started the step (its last STEP_START event's pid) has exited."""
    from dagster import DagsterEventType

    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.STEP_START, ascending=False).records
    pids = [r.event_log_entry.dagster_event.pid for r in records
            if r.event_log_entry.dagster_event and r.event_log_entry.dagster_event.step_key == step_key]
    return bool(pids and pids[0]) and process_gone(pids[0])


def is_local(instance) -> bool:
    """A SQLite instance: its runs' processes are on this machine, where their pids can be checked."""
    return _is_sqlite(instance)


def _is_sqlite(instance) -> bool:
    from dagster._core.storage.event_log import ConsolidatedSqliteEventLogStorage, SqliteEventLogStorage

    return isinstance(instance.event_log_storage, (SqliteEventLogStorage, ConsolidatedSqliteEventLogStorage))


@contextmanager
def _claims_serialized(instance) -> Iterator[None]:
    """One claim at a time among the processes of a SQLite instance.

    Dagster's SQLite storage does not make a claim atomic across processes:
    two run workers claiming at the same moment can both take the same free
    slot row, and two creating a pool's default limit can each add a slot.
    Either way both runs held the pool at once (seen in CI). The lock is held
    for one claim attempt, never while waiting. A SQLite instance lives on one
    machine, so a file lock beside its storage covers every process using it.
    """
    if not _is_sqlite(instance):
        yield
        return
    with open(Path(instance.root_directory) / ".conductor-pool-claims.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _limited(instance, name: str) -> bool:
    """Whether the pool has a limit, first applying the instance default the
    way Dagster's executor does for `pool=`."""
    storage = instance.event_log_storage
    default = instance.global_op_concurrency_default_limit
    limits = {p.name: p for p in storage.get_pool_limits()}
    current = limits.get(name)
    if default is not None and (current is None or (current.from_default and current.limit != default)):
        storage.initialize_concurrency_limit_to_default(name)
        current = {p.name: p for p in storage.get_pool_limits()}.get(name)
    return current is not None
