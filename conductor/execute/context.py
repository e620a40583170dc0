"""One execution context: everything an executor needs, opened together and closed
together, for every caller that sends calls (a run's execute stage, an enrichment
job, the LLM planner's own planning calls).

It owns the work folder's journal and run cache, the response cache shared across
runs (SQLite, or the governor's server), the progress line and the executor (which
holds the governor: rate limits, calls in flight, budgets). What the work folder's
journal says was already spent, and what a killed process may have paid for
without logging it, counts against the budgets; `spend()` reports the caps' state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conductor.execute.cache import Cache
from conductor.execute.engine import ExecOptions, Executor
from conductor.execute.journal import Journal, ResumeState, count_unanswered
from conductor.execute.shared.cache import open_cache
from conductor.pool import Pool
from conductor.progress import Progress


def lost_in_flight(manifest: dict[str, Any]) -> dict[str, Any]:
    """A run's calls sent whose answers never came back (a killed process's, or cut off by
    timeout_s), as its manifest records them (none when it records nothing)."""
    return manifest.get("lost_in_flight") or {"calls": 0, "reserved_usd": 0.0}


def add_lost(*parts: dict[str, Any]) -> dict[str, Any]:
    """Lost-in-flight counts of several sources (runs, processes), added key by key."""
    total: dict[str, Any] = lost_in_flight({})
    for part in parts:
        for k, v in part.items():
            total[k] = total.get(k, 0) + v
    return total


class ExecutionContext:
    """`with ExecutionContext(work, pool, options, state=...) as ex:` gives an Executor
    whose journal and caches are closed on leaving, whatever happened."""

    def __init__(self, work: Path, pool: Pool, options: ExecOptions, *, state: ResumeState,
                 cache_path: str | Path | None = None, progress: Progress | None = None,
                 spent_before: dict[str, float] | None = None, **executor_options: Any):
        self.work = Path(work)
        self.pool = pool
        self.options = options
        self.state = state
        self.cache_path = cache_path
        self.progress = progress or Progress(enabled=False)
        self.spent_before = spent_before or {}  # e.g. what planning spent, for the same budgets
        self.executor_options = executor_options
        self.executor: Executor | None = None
        self._open: list[Any] = []
        # calls killed processes sent whose answers never came back: maybe billed, in no step's cost
        self._lost_before = lost_in_flight({})

    def __enter__(self) -> Executor:
        try:
            cache = open_cache(self.cache_path, self.pool) if self.cache_path is not None else None
            if cache is not None:
                self._open.append(cache)
            run_cache = Cache(self.work / "responses.sqlite")
            self._open.append(run_cache)
            spent = dict(self.state.spent)
            for pid, usd in self.spent_before.items():
                spent[pid] = spent.get(pid, 0.0) + usd
            claimable: dict[str, str] = {}  # request key -> id of the reservation its answer settles
            for rid, (key, pid, usd) in self.state.unsettled.items():
                # Sent by a killed process, maybe paid: counted, unless its answer waits in the run
                # cache with no step row yet (the resume claims and counts it, once per answer). A key
                # a later process sent again and logged was paid twice: that row counts the other.
                if key not in self.state.paid and key not in claimable and run_cache.get(key) is not None:
                    claimable[key] = rid
                    continue
                count_unanswered(self._lost_before, usd)
                if usd is not None:
                    spent[pid] = spent.get(pid, 0.0) + usd
            journal = Journal(self.work, answers_first=run_cache.flush)
            self._open.append(journal)
            for rid in claimable.values():
                # Settled here, since the claim's step row carries the answer's cost: left open, every
                # later command would count the call again as lost in flight. Should this process die
                # before logging the claim, the next one claims the answer from the run cache all the same.
                journal.settled(rid, 0.0)
            self.executor = Executor(self.pool, journal, self.options, cache=cache, run_cache=run_cache,
                                     progress=self.progress, spent=spent, paid=self.state.paid,
                                     **self.executor_options)
            return self.executor
        except BaseException:
            self._close()
            raise

    def __exit__(self, *exc: Any) -> None:
        self._close()

    @property
    def lost_in_flight(self) -> dict[str, Any]:
        """Calls sent whose answers never came back, maybe billed: those of killed processes,
        and this process's requests cut off by timeout_s (their reservations stay unsettled,
        so a resume counts them again from the journal, once)."""
        return add_lost(self._lost_before, self.executor.unanswered if self.executor is not None else {})

    def spend(self) -> list[dict[str, Any]]:
        """Each budget cap: what it allows and what was spent under it."""
        return self.executor.ledger.summary() if self.executor is not None else []

    def _close(self) -> None:
        """Close everything opened, even when one close fails (a full disk); then raise the first failure."""
        first = None
        while self._open:
            try:
                self._open.pop().close()
            except BaseException as e:  # noqa: BLE001 - raised below, after the rest is closed
                first = first or e
        if first is not None:
            raise first
