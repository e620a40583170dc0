"""The async executor: runs plans' steps as calls to their workers, under the
providers' limits and budgets, through the cache, writing every finished step
and plan to the journal as it happens.

Plans stream in from an iterator and at most `max_plans_in_flight` are held at
once, so memory stays flat however large the run. Within a plan, a step starts
as soon as every step it can see has finished. A step with a condition (`when`)
waits for the steps it reads and runs only if it holds; otherwise it is
`skipped` at no cost, and the plan's answer is the last output that ran. A step
that may see only skipped steps is skipped as well.

A step given to a worker of kind "planner" re-plans: a `Replanner` writes a
sub-workflow over the outputs the step sees, which runs one level deeper (trace
paths "2.plan" for the planning, "2.0", "2.1", ... for its steps, at most
`max_depth` levels); its last output is the step's output. LLM planners make
that call through `call_worker` like any other.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import random
import sqlite3
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

from conductor.context import step_messages
from conductor.errors import ConductorError, Terminated
from conductor.execute.batch import ONLINE_NOTE, Batches
from conductor.execute.budget import BudgetExhausted
from conductor.execute.cache import Cache, Entry, cache_key
from conductor.execute.cached import serve_cached
from conductor.execute.call import (CallFailure, CallRequest, CallResponse, complete,
                                    max_prompt_tokens, maybe_billed)
from conductor.tokens import prompt_params, prompt_tokens
from conductor.execute.journal import STEPS_FILE, Journal, ResumeState, count_unanswered
from conductor.execute.limits import ProviderLimiter
from conductor.execute.openai_http import OpenAIEndpoint, direct_model
from conductor.execute.prices import call_cost, resolve_price
from conductor.execute.reserve import SpaceReserve
from conductor.execute.failure import Aborted, Billed, StepFailed
from conductor.execute.structured import combine_records, records_agree, structured_call
from conductor.grading import answers_agree
from conductor.masking import mask
from conductor.plans import Condition, Plan, Step
from conductor.pool import DEFAULT_MAX_TOKENS, Pool, Worker
from conductor.progress import Progress
from conductor.execute.shared import GovernorUnavailable, build_governor
from conductor.execute.shared.url import governor_failure_kind


def _sent_note(steps: int, unsent: int) -> str:
    """How many of the steps a governor outage failed sent no request: one that had sent a
    request before its retry was held back is no call "not sent" (that request counts in `calls`)."""
    if unsent == steps:
        return "it sent no request" if steps == 1 else "none of them sent a request"
    if unsent == 0:
        return ("its retry was held back after a request it sent" if steps == 1 else
                "each had sent a request before its retry was held back")
    return f"{unsent:,} of them sent no request; the other {steps - unsent:,} had sent one before a retry was held back"


@dataclass  # not frozen: a frozen one of nine fields costs five times as much to build, one per plan
class PlanJob:
    plan_id: str
    query_id: str
    query_index: int
    sample: int
    task: str | None
    prompt: str
    plan: Plan | None
    error: str | None = None  # why the plan is invalid
    # Set for an enrichment job with fields (conductor.execute.structured.RecordSpec):
    # every llm step must answer with a record under its schema, repaired at most once.
    record: Any = None
    # Ask again rather than take the shared cache's answer: an enrichment row whose last
    # answer was no valid record (the cache would hand back the same one).
    refresh: bool = False


@dataclass(frozen=True)
class ExecOptions:
    run_id: str
    refresh: bool = False  # ignore cached answers (still store fresh ones)
    run_budget_usd: float | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_plans_in_flight: int | None = None
    backoff_base_s: float = 0.25
    backoff_max_s: float = 30.0
    # The longest a provider may ask us to wait (Retry-After, a rate-limit reset): asked for
    # longer, the calls fail as rate-limited and a rerun sends them, instead of a run that hangs.
    max_wait_s: float = 600.0
    seed: int = 0
    # On Ctrl-C (or SIGTERM), how long the calls already sent may take to come back: kept, their
    # answers are not paid again by the rerun. Under Kubernetes' default 30 s grace period.
    drain_s: float = 20.0
    # How long a call the shared governor keeps back (nothing sent) waits for it, from when the outage
    # began: a Redis restart or a quick failover fails nothing; one that stays down fails the calls.
    governor_wait_s: float = 30.0


# A worker of kind "function" runs locally: (function name, step, granted outputs in order, task) -> text.
FunctionRunner = Callable[[str, Step, list[str], "str | None"], str]


@dataclass
class ReplanRequest:
    """A step assigned to a worker of kind "planner": write the workflow that does its work."""

    job: PlanJob
    path: str  # the re-planning step, e.g. "2" (or "2.1" inside a sub-workflow)
    depth: int  # the step's depth; its sub-workflow runs at depth + 1
    step: Step
    worker: Worker  # the pool's planner worker the step names
    prior: list[tuple[str, str]]  # (instruction, output) of the steps it has access to
    may_replan: bool  # whether the sub-workflow may itself hold re-planning steps (max_depth)
    # Set by a replanner that wrote the planning row itself (through call_worker,
    # with the sub-plan accepted); otherwise the executor writes it.
    recorded: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # raw text, tokens: for the row the executor writes

    @property
    def plan_path(self) -> str:
        """Trace path of the planning itself: "2.plan"; its steps are "2.0", "2.1", ..."""
        return f"{self.path}.plan"


# A worker of kind "planner" re-plans: (executor, request) -> the validated sub-plan.
# Raise StepFailed (status kept) or any exception (status "error") to fail the step.
Replanner = Callable[["Executor", ReplanRequest], Awaitable[Plan]]


# Plans taken from the job iterator at a time, to be answered from the caches in bulk.
CACHED_BATCH = 256

# Errors of the disk or the databases on it (full, read-only, gone): they abort the
# run, since nothing paid could be recorded, and a rerun after freeing space resumes.
STORAGE_ERRORS = (OSError, sqlite3.DatabaseError)


_governor_log = logging.getLogger("conductor.governor")
_GOVERNOR_POLL_S = 1.0  # the longest a call kept back by the shared governor waits before asking again
_MAYBE = object()  # billed_usd of a request cut off unanswered: the provider may have billed it
_log = logging.getLogger("conductor.execute")
# How often a run checks that its journal is still the file it writes to (a stat): a work folder
# deleted mid-run was found only at the end, after every call was sent and paid into no record.
JOURNAL_CHECK_S = 2.0
# How often a run hands its spend so far to `on_spend` (the runner keeps it in the manifest): a run
# killed outright, or still running, showed no spend in the runs view, though its calls were paid.
SPEND_CHECKPOINT_S = 5.0


class WorkFolderGone(ConductorError):
    """The work folder (its journal) was deleted or replaced while the run sent calls: what was
    done since went to no record, so the run stops sending."""

    def __init__(self, folder: Path):
        super().__init__(f"the work folder {folder} was deleted while the run was executing (or replaced), and with "
                         f"it the journal of what was done: no new call was sent once that was seen. Rerun the same "
                         f"command to redo the run (answers in the shared response cache are not paid again)")
        self.folder = folder


class Executor:
    def __init__(self, pool: Pool, journal: Journal, options: ExecOptions, *,
                 cache: Cache | None = None, run_cache: Cache | None = None,
                 progress: Progress | None = None,
                 spent: dict[str, float] | None = None, paid: set[str] | None = None,
                 functions: FunctionRunner | None = None, replanner: Replanner | None = None,
                 max_depth: int = 1, reserve: SpaceReserve | None = None,
                 on_spend: Callable[[list[dict]], None] | None = None):
        self.pool = pool
        self.journal = journal
        self.opt = options
        # The pool's keys, masked in every error written, whatever path the message took
        self._keys = tuple(k for p in pool.providers.values() if p.api_key_env and (k := os.environ.get(p.api_key_env)))
        self.cache = cache  # shared across runs; None with --no-cache
        self.run_cache = run_cache  # this run's answers, so a resumed run never pays twice
        self._paid = set(paid or ())  # run-cache keys whose paid call has a trace row
        self.progress = progress or Progress(enabled=False)
        self.functions = functions
        self.replanner = replanner
        self.max_depth = max_depth
        self.on_spend = on_spend  # given the ledger's summary every SPEND_CHECKPOINT_S while it changes
        self.prices = {w.id: resolve_price(w) for w in pool.workers}
        # In this process, or shared with other processes through the pool's governor URL
        self.limiters, self.ledger, self._close_governor = build_governor(pool, options.run_budget_usd, spent)
        self._budgeted = {pid for pid, p in pool.providers.items()
                          if p.budget_usd is not None or options.run_budget_usd is not None}
        self._inflight: dict[str, asyncio.Future] = {}
        self._dead: dict[str, tuple[str, str]] = {}  # worker or provider id -> why every call to it fails, kind
        self._held: dict[str, tuple[float, str]] = {}  # provider id -> (monotonic time its limit resets, why)
        self._abort: BaseException | None = None  # the storage error (or Ctrl-C) that stops the run
        self._sending = 0  # online calls sent whose answers have not come back
        self._held_back = 0  # calls waiting for the shared governor now (wait_for_governor)
        # Per provider, a call's place among its max_concurrency in this process, taken before its budget
        # reservation: reserved before it, every queued step held a worst case (a kill -9 left 54 on a
        # provider of 16, charged in full when their leases ended; audit79 F2)
        self._places = {pid: asyncio.Semaphore(p.max_concurrency) for pid, p in pool.providers.items()}
        # requests cut off by timeout_s: maybe answered and billed, charged at their worst case
        # (as a killed process's calls are); their reservations stay unsettled in the journal
        self.unanswered: dict[str, Any] = {"calls": 0, "reserved_usd": 0.0}
        # steps that failed because the shared governor could not be used, by why ("unreachable",
        # "refused"): [steps, those of them that sent no request at all] (the others' retry was held
        # back), said in one line at the end, not one per step or attempt
        self.not_sent: dict[str, list[int]] = {}
        self._clients: dict[tuple[str, str | None], Any] = {}  # (api_base, key) -> client, for this run
        self._plan_tasks: set[asyncio.Task] = set()
        self.reserve = reserve  # disk space freed on the first storage error, for the answers in flight
        self._sub_plans: dict[str, dict[str, str]] = {}  # from the journal: plan id -> step path -> sub-plan
        self._rng = random.Random(options.seed)
        self._stamps: dict[float, str] = {}  # time -> ISO text, see _stamp
        # providers with mode: batch send through their batch API (conductor.execute.batch)
        self.batches = Batches(self) if any(p.mode == "batch" for p in pool.providers.values()) else None

    # ---- plans -----------------------------------------------------------

    async def run(self, jobs: Iterable[PlanJob], resume: ResumeState | None = None) -> None:
        resume = resume or ResumeState()
        self._sub_plans = resume.sub_plans
        # Everything loaded so far (litellm alone is hundreds of thousands of objects) is
        # moved out of the collector's reach: otherwise each full collection walks it again,
        # which cost a quarter of the executor's CPU per call. (No collection first: on a
        # heap this size it alone takes longer than a cached rerun of thousands of steps.)
        gc.freeze()
        restore = self._stop_gently_on_ctrl_c()
        interrupted: list[int] = []
        watch = asyncio.ensure_future(self._watch_journal())
        checkpoint = asyncio.ensure_future(self._checkpoint_spend()) if self.on_spend is not None else None
        try:
            await self._run(jobs, resume)
        finally:
            watch.cancel()
            if checkpoint is not None:
                checkpoint.cancel()
            interrupted = restore()
            gc.unfreeze()
            # Interrupted (Ctrl-C): stop the plans still running before closing their sessions,
            # or one of them opens a new session that nobody closes.
            for task in self._plan_tasks:
                task.cancel()
            await asyncio.gather(*self._plan_tasks, return_exceptions=True)
            await self.close_connections()
        if interrupted:  # Ctrl-C came after the last plan ended: still an interrupt, not a silent finish
            raise _interrupt(interrupted)

    async def gather_gently(self, coros: Iterable[Awaitable[Any]]) -> list[Any]:
        """`asyncio.gather` for callers that make their calls through this executor outside `run`
        (the LLM planner): Ctrl-C or SIGTERM stops new calls and awaits those in flight, as `run`
        does, then raises KeyboardInterrupt (Terminated). Cut off, their answers were paid for and
        sent again by the rerun. A failure stops new calls too, and is raised once the rest end."""
        restore = self._stop_gently_on_ctrl_c()
        tasks = [asyncio.ensure_future(c) for c in coros]
        self._plan_tasks.update(tasks)

        def stop_on_failure(t: asyncio.Future) -> None:  # as in `run`: no new call; those in flight end
            e = None if t.cancelled() else t.exception()
            if e is not None and self._abort is None and not isinstance(e, Aborted):
                self._abort = e

        for task in tasks:
            task.add_done_callback(stop_on_failure)
        came: list[int] = []
        try:
            # Every task ends before this does, not only the first to fail: after a signal, a call
            # that then gets a slot raises Aborted at once, and ending on it cut off the calls still
            # in flight (paid, and sent again by the rerun). The drain cancels what is left.
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                raise next((e for e in failed if not isinstance(e, (Aborted, asyncio.CancelledError))), failed[0])
            return outcomes
        finally:
            came = restore()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._plan_tasks.difference_update(tasks)
            if came:
                raise _interrupt(came)  # noqa: B012 - the signal, not what the cancelled calls raised

    def _stop_gently_on_ctrl_c(self) -> Callable[[], list[int]]:
        """Ctrl-C or SIGTERM stops sending and waits up to `drain_s` for the calls already sent,
        whose answers are then kept: cancelled, they would be billed and sent again by the rerun.
        A second signal stops at once. Then the run raises KeyboardInterrupt (Terminated for
        SIGTERM). SIGINT is left alone where it is ignored (a background job: the terminal's
        Ctrl-C is not for it); SIGTERM is taken over only from a handler that asks for it
        (`as_ctrl_c`: the CLI's), not from a host such as Dagster's run worker. Returns what
        undoes it, which gives the signals that came."""
        import signal
        import sys
        import threading

        loop = asyncio.get_running_loop()
        if threading.current_thread() is not threading.main_thread():
            return lambda: []
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        if previous[signal.SIGINT] in (signal.SIG_IGN, None):
            del previous[signal.SIGINT]
        if not getattr(previous[signal.SIGTERM], "as_ctrl_c", False):
            del previous[signal.SIGTERM]

        def stop_plans() -> None:
            for task in self._plan_tasks:
                task.cancel()

        def cut_off(stopping: str, where: str = "in flight") -> None:
            """Say how many calls the stop cuts off: maybe billed, and sent again by the rerun, whose
            summary counts them as lost in flight; only the rerun said so."""
            if self._sending:
                print(f"conductor: {stopping}: {self._sending} call(s) {where} cut off; the provider may bill "
                      f"them, and the rerun sends them again (its summary counts them as lost in flight)",
                      file=sys.stderr, flush=True)

        async def drain() -> None:
            deadline = time.monotonic() + self.opt.drain_s
            while self._sending and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            cut_off("stopping", f"still in flight after {self.opt.drain_s:g} s")
            stop_plans()  # what is left waits for a slot, a retry or a batch: nothing in flight online

        def on_ctrl_c() -> None:
            if drains:
                if not drains[0].done():  # the drain has not stopped the plans already
                    cut_off("stopping now")
                stop_plans()
                return
            self._abort = self._abort or _interrupt(came)
            print(f"\nconductor: stopping: no new call is sent; waiting up to {self.opt.drain_s:g} s for "
                  f"{self._sending} call(s) in flight so their answers are kept (the same signal again stops now)",
                  file=sys.stderr, flush=True)
            drains.append(loop.create_task(drain()))

        # A Python-level handler, not loop.add_signal_handler: it records the signal the moment it
        # comes, so one that comes while the run winds down is seen by restore() and not lost.
        came: list[int] = []

        def on_signal(signum, frame) -> None:
            came.append(signum)
            loop.call_soon_threadsafe(on_ctrl_c)

        drains: list[asyncio.Task] = []
        for signum in previous:
            signal.signal(signum, on_signal)

        def restore() -> list[int]:
            for signum, handler in previous.items():  # from here a Ctrl-C is asyncio's again
                signal.signal(signum, handler)
            for task in drains:
                task.cancel()
            return came

        return restore

    async def close_connections(self) -> None:
        """Close the HTTP sessions, batch followers and governor connection opened for calls,
        in the event loop that opened them (callers of `call_worker` outside `run` too)."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
        batches, self.batches = self.batches, None
        if batches is not None:
            await batches.close()
        if self._close_governor is not None:
            close, self._close_governor = self._close_governor, None
            self._say_not_sent()
            await close()

    def _say_not_sent(self) -> None:
        """One line for the steps a shared governor outage failed, saying how many of them sent
        no request (the others had sent one whose retry was then held back); the outage itself
        was said once when it began (conductor.execute.shared.governor)."""
        for why, (n, unsent) in sorted(self.not_sent.items(), reverse=True):
            steps = "1 step failed" if n == 1 else f"{n:,} steps failed"
            if why == "unreachable":
                _governor_log.warning("%s on the shared governor (%s): it was unreachable; rerun the same command "
                                      "once it is back (a plan uses up none of its reruns on these)",
                                      steps, _sent_note(n, unsent))
            else:
                _governor_log.warning("%s on the shared governor (%s): it refused its URL's password, user or "
                                      "database number; fix the URL and rerun the same command",
                                      steps, _sent_note(n, unsent))
        self.not_sent = {}

    async def _watch_journal(self) -> None:
        """Stop sending once the journal is no longer the file this run writes to (its work folder
        deleted or replaced): whatever was sent since went to no record, the run's spend included,
        and was found only at the end, after every call was sent. One stat every JOURNAL_CHECK_S."""
        path = self.journal.folder / STEPS_FILE

        def identity() -> tuple[int, int] | None:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return None
            return st.st_dev, st.st_ino

        try:
            opened = identity()
        except OSError:  # cannot tell (permissions, a network disk): the journal's writes will say
            return
        while self._abort is None:
            try:
                now = identity()
            except OSError:
                now = opened
            if now is None or now != opened:
                self._abort = WorkFolderGone(self.journal.folder)
                _log.warning("conductor: the work folder %s was deleted (or replaced) mid-run: no new call is sent; "
                             "waiting for the %d call(s) in flight", self.journal.folder, self._sending)
                return
            await asyncio.sleep(JOURNAL_CHECK_S)

    async def _checkpoint_spend(self) -> None:
        """Hand the spend so far to on_spend whenever it changed, every SPEND_CHECKPOINT_S. A write
        that fails is left to the journal's own writes to report."""
        last = None
        while self._abort is None:
            await asyncio.sleep(SPEND_CHECKPOINT_S)
            spend = self.ledger.summary()
            if spend != last:
                try:
                    self.on_spend(spend)
                    last = spend
                except (OSError, ConductorError):  # a full disk, a damaged manifest: said by what writes next
                    pass

    async def _run(self, jobs: Iterable[PlanJob], resume: ResumeState) -> None:
        limit = self.opt.max_plans_in_flight or max(
            32, min(4096, 4 * sum(p.max_concurrency for p in self.pool.providers.values())),
            # a batch holds as many steps as are ready at once: let that many plans be in flight
            sum(p.batch_max_requests for p in self.pool.providers.values() if p.mode == "batch"))
        slots = asyncio.Semaphore(limit)
        tasks: set[asyncio.Task] = self._plan_tasks
        failure: list[BaseException] = []

        def done(t: asyncio.Task) -> None:
            tasks.discard(t)
            slots.release()
            if not t.cancelled() and t.exception() is not None:
                failure.append(t.exception())
                if self._abort is None and not isinstance(t.exception(), Aborted):
                    self._abort = t.exception()

        it = iter(jobs)
        while not (failure or self._abort is not None):
            chunk = list(itertools.islice(it, min(limit, CACHED_BATCH)))
            if not chunk:
                break
            # The plans of the chunk that the caches answer whole are written at once
            # (conductor.execute.cached); the others run as tasks.
            try:
                batch = serve_cached(self, [j for j in chunk if j.plan_id not in resume.finished], resume.outputs)
            except STORAGE_ERRORS as e:
                self._abort = self._abort or e
                break
            for job in batch:
                await slots.acquire()
                if failure or self._abort is not None:
                    break
                t = asyncio.create_task(self._run_plan(job, resume.outputs.pop(job.plan_id, {})))
                tasks.add(t)
                t.add_done_callback(done)
            await asyncio.sleep(0)  # a loop turn: the batch's rows are written, progress is shown
        while tasks:
            await asyncio.wait(set(tasks))
        for store in (self.run_cache, self.cache, self.journal):  # the last loop turn's answers and rows
            if store is not None:
                try:
                    self._durably(store.flush)
                except STORAGE_ERRORS as e:
                    self._abort = self._abort or e
        await self.close_connections()
        self.progress.close()
        if self._abort is not None:
            raise self._abort
        if failure:
            raise failure[0]

    async def _run_plan(self, job: PlanJob, restored: dict[str, str]) -> None:
        t0 = time.time()
        if job.plan is None:
            self._finish_plan(job, "invalid_plan", None, job.error, [], t0, failure="plan")
            return
        rows = await self.run_steps(job, job.plan, restored, prefix="", depth=0)
        last = plan_outcome(rows)
        failed = next((r for r in rows if r["status"] not in ("ok", "skipped")), None)
        self._sub_plans.pop(job.plan_id, None)
        if failed is None and last is not None:
            self._finish_plan(job, "ok", last["response_text"], None, rows, t0)
        else:
            status = failed["status"] if failed else "error"
            self._finish_plan(job, status, None, failed["error"] if failed else "no output", rows, t0,
                              failure=failed.get("failure") if failed else "other")

    async def run_steps(self, job: PlanJob, plan: Plan, restored: dict[str, str], prefix: str,
                        depth: int) -> list[dict[str, Any]]:
        """Run a plan's steps; returns one row per step (restored steps included, marked)."""
        steps = plan.steps
        outputs: dict[int, str] = {}
        rows: dict[int, dict[str, Any]] = {}
        futures: dict[int, asyncio.Future] = {}
        stop = asyncio.Event()

        async def run_one(i: int) -> None:
            step = steps[i]
            path = f"{prefix}{i}"
            for j in step.waits_for:
                await futures[j]
            done = next((p for p in (path, f"{path}.repair") if p in restored), None)
            if done is not None:  # a record step may have finished with its repair call
                outputs[i] = restored[done]
                rows[i] = {"status": "ok", "response_text": restored[done], "restored": True, "error": None}
                return
            if stop.is_set() or any(rows[j]["status"] != "ok" and not rows[j].get("condition_false")
                                    for j in step.waits_for):
                rows[i] = self._log_step(job, path, depth, step, status="skipped",
                                         error="an earlier step of this plan failed")
                return
            if step.access and all(rows[j].get("condition_false") for j in step.access):
                # e.g. a vote over an escalation that was not needed: the answer stays the last that ran
                rows[i] = {**self._log_step(job, path, depth, step, status="skipped", cost=0.0,
                                            error=f"every step it may see ({', '.join(map(str, step.access))}) "
                                                  f"was skipped by its condition"),
                           "condition_false": True}
                return
            if step.when is not None:
                holds, why = condition_holds(step.when, outputs, job.task,
                                             records_agree if job.record is not None else None)
                if not holds:
                    rows[i] = {**self._log_step(job, path, depth, step, status="skipped", cost=0.0,
                                                error=f"condition {step.when} is false: {why}"),
                               "condition_false": True}
                    return
            t0 = time.time()  # a failed step's row spans its retries, as an answered one's does
            try:
                rows[i] = await self._run_step(job, plan, i, outputs, restored, path, depth)
                outputs[i] = rows[i]["response_text"]
            except StepFailed as f:
                rows[i] = {**self.log_failure(job, path, depth, step, f, started=t0), "failure": f.kind}
            except Aborted:
                raise
            except STORAGE_ERRORS as e:
                self._abort = self._abort or e
                raise
            except Exception as e:  # a bug or an odd input in one step fails its plan, never the batch
                rows[i] = {**self._log_step(job, path, depth, step, status="error", failure="other", started=t0,
                                            error=f"step {path}: unexpected {type(e).__name__}: {e}"),
                           "failure": "other"}
            if rows[i]["status"] != "ok":
                stop.set()

        for i in range(len(steps)):
            futures[i] = asyncio.ensure_future(run_one(i))
        # Every step ends before the plan does (a call in flight is paid: its answer is kept).
        for outcome in await asyncio.gather(*futures.values(), return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
        return [rows[i] for i in range(len(steps))]

    def _finish_plan(self, job: PlanJob, status: str, answer: str | None, error: str | None,
                     rows: list[dict[str, Any]], t0: float, failure: str | None = None,
                     ended: float | None = None, out: list[dict[str, Any]] | None = None) -> None:
        """Write the plan's row (or add it to `out`, for the caller to write with others)."""
        t1 = ended or time.time()
        calls = hits = 0  # of the steps this run did (not restored, not skipped)
        for r in rows:
            if not r.get("restored") and r["status"] != "skipped":
                calls += 1 if r.get("attempts") else 0
                hits += 1 if r.get("cache_hit") else 0
        row = {
            "run_id": self.opt.run_id, "plan_id": job.plan_id, "query_id": job.query_id,
            "query_index": job.query_index, "sample": job.sample, "status": status,
            "final_answer": answer, "error": error and mask(error, *self._keys),
            "calls": calls, "cache_hits": hits,
            "started_at": self._stamp(t0), "ended_at": self._stamp(t1), "wall_time_s": round(t1 - t0, 6),
            "failure": failure,  # the failure's kind: a rerun retries transient ones (journal.TRANSIENT_KINDS)
        }
        if out is None:
            self._durably(self.journal.plan, row)
        else:
            out.append(row)
        self.progress.c.plans_done += 1
        self.progress.tick()

    # ---- steps -----------------------------------------------------------

    async def _run_step(self, job: PlanJob, plan: Plan, i: int, outputs: dict[int, str],
                        restored: dict[str, str], path: str, depth: int) -> dict[str, Any]:
        step = plan.steps[i]
        worker = self.pool.worker(step.worker)
        if worker.kind == "function":
            return self._run_function(job, plan, i, outputs, path, depth, worker)
        if worker.kind == "planner":
            return await self._replan(job, plan, i, outputs, restored, path, depth)
        messages = step_messages(step, plan.steps, outputs, worker.system)
        if job.record is not None:
            return await structured_call(self, job, path, depth, step, worker, messages)
        return await self.call_worker(job, path, depth, step, worker, messages)

    async def call_worker(self, job: PlanJob, path: str, depth: int, step: Step, worker: Worker,
                          messages: list[dict[str, str]], *, params: dict[str, Any] | None = None,
                          accept: Callable[[Entry], dict[str, Any] | None] | None = None) -> dict[str, Any]:
        """One step's call: cache, budget, limits, retries. Raises StepFailed.

        `params` add to (and override) the worker's sampling parameters; they are
        part of the cache key. `accept(entry)` sees the response before its row
        is written and returns extra row fields (sub_plan); if it raises
        StepFailed, the row is written with that status and error (the paid
        response stays cached) and the failure propagates.
        """
        params, key = self.request_key(worker, messages, params)
        t0 = time.time()
        for cache in (self.run_cache, None if self.opt.refresh or job.refresh else self.cache):
            hit = cache.get(key) if cache is not None else None
            if hit is None:
                continue
            if cache is self.run_cache and key not in self._paid:
                return self._claim_row(job, path, depth, step, worker, key, hit, t0, accept)
            return self._cached_row(job, path, depth, step, worker, key, hit, t0, accept)
        if key in self._inflight:  # the same request is already on its way: share its answer
            shared = await asyncio.shield(self._inflight[key])
            if isinstance(shared, StepFailed):  # the owner's exact status: budget_exhausted stays resumable
                raise StepFailed(shared.status, f"an identical request in this run failed: {shared}",
                                 kind=shared.kind)
            if not isinstance(shared, Entry):
                raise Aborted() if self._abort is not None else StepFailed(
                    "error", f"an identical request in this run failed: {type(shared).__name__}: {shared}",
                    kind="other")
            return self._cached_row(job, path, depth, step, worker, key, shared, t0, accept)
        if self._abort is not None:
            raise Aborted()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        outcome: Any = None  # what waiters on the same request get, set on every path
        try:
            mode = "online"
            if self.batches is not None and self.pool.provider_of(worker).mode == "batch":
                resp, attempts, latency = await self.batches.call(worker, messages, params, key)
                mode = "online" if (resp.warning or "").startswith(ONLINE_NOTE) else "batch"
            else:
                resp, attempts, latency = await self._call_with_retries(worker, messages, params, key)
            cost = self._cost(worker, resp)
            # the price it was paid at: none when the server stated the cost (a batch line's is ours)
            price = self.prices[worker.id] if mode == "batch" or resp.cost_usd is None else None
            entry = outcome = Entry(resp.text, resp.prompt_tokens, resp.completion_tokens, resp.usage_estimated,
                                    resp.simulated, cost, latency, resp.logprob, attempts,
                                    None if price is None else price.input,
                                    None if price is None else price.output, mode)
            for cache in (self.run_cache, self.cache):
                if cache is not None:
                    self._durably(cache.put, key, worker.model, entry)
            self._paid.add(key)
        except BaseException as e:
            if isinstance(e, STORAGE_ERRORS):
                self._abort = self._abort or e
            if outcome is None:
                outcome = e
            raise
        finally:
            del self._inflight[key]
            if not fut.done():
                fut.set_result(outcome)
        c = self.progress.c
        c.calls += 1
        c.usd += cost or 0.0
        return self._accepted_row(job, path, depth, step, worker, accept, attempts=attempts,
                                  request_key=key, entry=entry, cost=cost, started=t0, error=resp.warning)

    def request_key(self, worker: Worker, messages: list[dict[str, str]],
                    params: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
        """The call's sampling parameters (the worker's, then `params`, max_tokens set) and its cache key."""
        params = {**worker.params, **(params or {})}
        params.setdefault("max_tokens", self.opt.default_max_tokens)
        return params, cache_key(worker.model, worker.api_base, messages, params)

    def _accepted_row(self, job: PlanJob, path: str, depth: int, step: Step, worker: Worker, accept,
                      **row: Any) -> dict[str, Any]:
        extra, failure = None, None
        if accept is not None:
            try:
                extra = accept(row["entry"])
            except StepFailed as f:
                failure = f
        if failure is None:
            return self._log_step(job, path, depth, step, worker=worker, status="ok", extra=extra, **row)
        # A usage warning gives way to the failure's message; a batch line's online note stays in front
        # of it: the run's summary counts online answers from these notes, as its closing line does.
        note = row.pop("error", None)
        error = f"{note}; {failure}" if note and note.startswith(ONLINE_NOTE) else str(failure)
        logged = self._log_step(job, path, depth, step, worker=worker, status=failure.status, error=error,
                                failure=failure.kind, **row)
        raise StepFailed(failure.status, str(failure), row.get("attempts", 0), kind=failure.kind, row=logged)

    async def _call_with_retries(self, worker: Worker, messages: list[dict[str, str]], params: dict[str, Any],
                                 key: str, attempts_before: int = 0,
                                 sent_before: int | None = None) -> tuple[CallResponse, int, float]:
        """Online attempts until an answer: (response, requests sent, latency). `attempts_before`:
        the tries a batch already made (they count towards max_attempts), `sent_before` those of
        them whose request was sent (default: all). An attempt whose request never left (a batch
        never submitted) counts towards max_attempts, not as sent: a step's `attempts` and a plan's
        `calls` count requests that were sent. A wait for the shared governor is no attempt: it is
        bounded by time (wait_for_governor)."""
        provider = self.pool.provider_of(worker)
        n_sent = attempts_before if sent_before is None else sent_before
        self._check_alive(worker, provider, n_sent)
        api_key = os.environ.get(provider.api_key_env) if provider.api_key_env else None
        if api_key is None and worker.api_base:
            api_key = "no-key"  # OpenAI-compatible local servers need some value
        req = CallRequest(worker.model, messages, params, worker.api_base, provider.timeout_s, key,
                          self._client(worker, api_key, track_sent=provider.rpm is not None))
        est_in, pt_bound = prompt_tokens(messages, params)
        est_tokens = est_in + params["max_tokens"]
        reservation = rid = None
        price = self.prices[worker.id]
        # UTF-8 bytes bound the prompt's tokens in any script (chars/4 undercounts CJK 4x), the schema's
        # and tools' in params too; a recorded cost (replay) is charged as it is, unclamped, so its
        # largest bounds the call too
        worst = None if price is None else max(pt_bound * price.input
                                               + params["max_tokens"] * price.output, worker.max_call_usd or 0.0)
        if provider.id in self._budgeted:
            if price is None:
                raise StepFailed("error", f"worker {worker.id}: no known price for model {worker.model}, so it "
                                          f"cannot run under a budget; add price: {{input_per_mtok, "
                                          f"output_per_mtok}} to it in the pool file", kind="config")
        limiter = self.limiters[provider.id]
        attempt = attempts_before
        # An answer in hand still counts as in flight while its settlement awaits a shared governor:
        # a Ctrl-C drain that saw no call in flight then cancelled it, and the rerun paid for it again.
        # And a cancel during that settlement settles it at what it was billed, not at $0
        # (billed_usd None: not billed; _MAYBE: cut off unanswered, maybe billed).
        sending_counted = False
        billed_usd: Any = None
        kept_back: float | None = None  # when the shared governor first kept this call back (see wait_for_governor)
        # The reservation is taken once the call has its place among the provider's max_concurrency in this
        # process, and settled before the place is given up: a process holds at most max_concurrency per
        # provider. A call keeps its place while it waits for budget room. That cannot deadlock: every
        # reservation it waits on belongs to a call that has its place already (or to a batch) and waits
        # for nothing but its rate slot and its answer.
        place = self._places[provider.id]
        placed = False
        try:
            while True:
                attempt += 1
                sending = False  # this attempt's request may have left: if cut off now, maybe billed
                if self._abort is not None:
                    raise Aborted()
                await place.acquire()
                placed = True
                if reservation is None and provider.id in self._budgeted:
                    try:
                        reservation = await self._reserve(worker, provider, worst, n_sent)
                    except GovernorUnavailable as f:  # not sent: waited for by time, as the limiter's outages
                        place.release()  # the wait below holds no place
                        placed = False
                        if not f.retryable:
                            raise StepFailed("error", self._failure_message(worker, provider, f, attempt),
                                             n_sent, kind=f.kind) from None
                        kept_back = await self.wait_for_governor(worker, f, kept_back, n_sent)
                        attempt -= 1  # no attempt: nothing was sent
                        continue
                try:
                    async with limiter.slot(est_tokens) as sent:
                        # Checked again once a slot is free: while this call waited, another
                        # may have found the key rejected or the limit spent for hours.
                        try:
                            self._check_alive(worker, provider, n_sent)
                        except StepFailed:
                            limiter.settle_tokens(est_tokens, 0)  # never sent: its tokens go back
                            raise
                        if self._abort is not None:  # stopped while this call waited for its slot
                            limiter.settle_tokens(est_tokens, 0)
                            raise Aborted()
                        if rid is None:
                            # Journaled when the call is about to leave, not while it waits for a slot, and
                            # under no budget too: a resume counts an unsettled one as sent and maybe billed.
                            rid = self._durably(self.journal.reservation, key, provider.id, worst)
                        t = time.monotonic()
                        self._sending += 1
                        self.progress.c.requests += 1
                        sending = True
                        n_sent += 1
                        try:
                            resp = await complete(req, api_key, sent)
                        except BaseException:
                            self._sending -= 1
                            raise
                        sending_counted = True  # until the answer is returned, to be kept (see finally)
                except CallFailure as f:
                    billed = self._billed(worker, f, messages, params, key)
                    limiter.settle_tokens(est_tokens, sum(billed.tokens) if billed else 0)
                    self._observe(limiter, provider, f.rate)
                    if billed is not None:  # an answer that cannot be kept, paid all the same
                        billed_usd = billed.cost or 0.0
                        if reservation is not None:
                            await self.ledger.settle(reservation, billed.cost or 0.0)
                            reservation = None
                        elif billed.cost:
                            self.ledger.record(provider.id, billed.cost)
                        self.progress.c.usd += billed.cost or 0.0
                        self._durably(self.journal.settled, rid, billed.cost or 0.0)
                    elif maybe_billed(f):
                        billed_usd = _MAYBE
                        await self._charge_unanswered(provider, reservation, worst)
                        reservation = None  # rid stays unsettled: a resume counts it as lost in flight
                    elif rid is not None:  # not billed: settled now, so a kill during the wait below
                        self._durably(self.journal.settled, rid, 0.0)  # counts nothing lost in flight
                    if reservation is not None:  # not billed: no reservation held through the wait
                        await self.ledger.settle(reservation, 0.0)
                        reservation = None
                    place.release()  # nor a place: the retry takes both again
                    placed = False
                    rid, billed_usd = None, None
                    if isinstance(f, GovernorUnavailable) and f.retryable:  # no slot: nothing was sent
                        kept_back = await self.wait_for_governor(worker, f, kept_back, n_sent)
                        attempt -= 1
                        continue
                    kept_back = None  # it got past the governor: a later outage is waited for afresh
                    too_long = f.retry_after is not None and f.retry_after > self.opt.max_wait_s
                    if too_long and f.kind == "rate_limit" and not f.headers_seen:
                        self._hold(provider, f.retry_after, "asked to retry in")  # the whole provider is out
                    if not f.retryable or attempt >= provider.max_attempts or too_long or billed is not None:
                        raise StepFailed("error", self._failure_message(worker, provider, f, attempt),
                                         n_sent, kind="not_found" if f.status == 404 else f.kind,
                                         billed=billed) from None
                    self.progress.c.retries += 1
                    await asyncio.sleep(self._backoff(attempt, f, limiter))
                    continue
                except asyncio.CancelledError:
                    if sending:  # maybe sent and paid: left unsettled, a resume counts it as lost in flight
                        rid = None
                    raise  # else it waited for a slot to retry: its failed attempts were not billed
                self._observe(limiter, provider, resp.rate)
                resp = self._clamped(resp, pt_bound, params)
                # after clamping: a tpm bucket that believed 1,000x usage would stall the run for hours
                limiter.settle_tokens(est_tokens, resp.prompt_tokens + resp.completion_tokens)
                cost = self._cost(worker, resp)
                billed_usd = cost or 0.0
                if reservation is not None:
                    await self.ledger.settle(reservation, cost or 0.0)
                    reservation = None
                elif cost:
                    self.ledger.record(provider.id, cost)
                try:
                    self._durably(self.journal.settled, rid, cost or 0.0)
                except STORAGE_ERRORS:
                    pass  # the run stops (see _durably); the answer is still kept, and a resume
                    # counts the unsettled reservation only if the answer was not kept
                rid = None
                return resp, n_sent, time.monotonic() - t
        finally:
            if sending_counted:
                self._sending -= 1
            try:
                if reservation is not None:
                    await self.ledger.settle(reservation,
                                             (worst or 0.0) if billed_usd is _MAYBE else billed_usd or 0.0)
            finally:
                if placed:  # after the settle: a place never has two reservations
                    place.release()
            if rid is not None and billed_usd is not _MAYBE:  # maybe billed: unsettled, a resume counts it
                try:
                    self.journal.settled(rid, billed_usd or 0.0)  # None: failed, no answer, nothing billed
                except STORAGE_ERRORS:
                    pass  # left unsettled: a resume counts it as spent, which errs on the safe side

    async def _reserve(self, worker: Worker, provider, worst: float, sent: int = 0) -> Any:
        """The call's worst case reserved; `sent`: the requests its earlier attempts sent, kept
        in the failure (a retry refused by the budget still sent, and maybe paid for, those).
        GovernorUnavailable passes through: the caller waits for the governor (wait_for_governor),
        which is no attempt, as nothing was sent."""
        try:
            return await self.ledger.reserve(provider.id, worst)
        except BudgetExhausted as e:
            raise StepFailed("budget_exhausted", f"worker {worker.id}: {e}", sent, kind="budget") from None

    async def _charge_unanswered(self, provider, reservation: Any, worst: float | None) -> None:
        """A request cut off by timeout_s may still be answered, and billed, by the provider:
        charged at its worst case to the budgets, as a killed process's call is, so that a
        provider that hangs cannot draw a budget past its cap."""
        if reservation is not None:
            await self.ledger.settle(reservation, worst or 0.0)
        elif worst:
            self.ledger.record(provider.id, worst)
        count_unanswered(self.unanswered, worst)

    def _client(self, worker: Worker, api_key: str | None, track_sent: bool = False) -> Any:
        """One direct client per OpenAI-compatible endpoint and key for the run (a worker
        with an api_base and an openai/ model); None: litellm's own for other providers.
        `track_sent`: the client reports when each request has left, for an rpm limit."""
        if direct_model(worker.api_base, worker.model) is None:
            return None
        k = (worker.api_base, api_key, track_sent)
        if k not in self._clients:
            self._clients[k] = OpenAIEndpoint(worker.api_base, api_key, track_sent)
        return self._clients[k]

    def _clamped(self, resp: CallResponse, pt_max: int, params: dict[str, Any]) -> CallResponse:
        """Reported usage no larger than the request could use (the prompt's UTF-8 bytes, with its
        response_format and tools, and max_tokens): budgets hold against a server that over-reports;
        the overrun is counted and kept in the row. An answer that carries its own cost (replayed
        logs) is charged that cost and left as it is."""
        if resp.cost_usd is not None:  # a recorded cost is what is charged; its tokens may be of another prompt
            return resp
        ct_max = params.get("max_tokens")  # pt_max: max_prompt_tokens of the request
        # 0 tokens for a prompt or an answer that has text cannot be: believed, budgets would never bind
        zero = resp.usage_reported and (resp.prompt_tokens == 0 or (resp.completion_tokens == 0 and resp.text))
        if (not resp.usage_reported or zero) and isinstance(ct_max, int):
            return replace(resp, prompt_tokens=pt_max, completion_tokens=ct_max, usage_estimated=True,
                           warning=("0 tokens reported for a prompt or answer with text" if zero else
                                    "no valid usage in the answer") +
                           ": counted at the request's upper bound (prompt UTF-8 bytes, max_tokens)")
        over = []
        if resp.prompt_tokens > pt_max:
            over.append(f"prompt_tokens {resp.prompt_tokens} > {pt_max} (the prompt's UTF-8 bytes"
                        f"{', with its response_format and tools' if prompt_params(params) else ''})")
        if isinstance(ct_max, int) and resp.completion_tokens > ct_max:
            over.append(f"completion_tokens {resp.completion_tokens} > max_tokens {ct_max}")
        if not over:
            return resp
        return replace(resp, prompt_tokens=min(resp.prompt_tokens, pt_max),
                       completion_tokens=min(resp.completion_tokens, ct_max if isinstance(ct_max, int)
                                             else resp.completion_tokens),
                       usage_estimated=True, warning="reported usage clamped: " + "; ".join(over))

    def _billed(self, worker: Worker, f: CallFailure, messages: list[dict[str, str]],
                params: dict[str, Any], key: str) -> Billed | None:
        """What a failed call was billed: a 200 whose answer could not be kept (a refusal, a
        content filter, an answer past the limits), charged as an answer would be: its
        reported usage, clamped, else the request's bounds; None for a failure the provider
        does not bill (an error status, a dropped connection)."""
        if not f.billed:
            return None
        pt, ct = f.usage if f.usage is not None else (0, 0)
        resp = self._clamped(CallResponse("", pt, ct, False, False, cost_usd=f.cost_usd,
                                          usage_reported=f.usage is not None),
                             max_prompt_tokens(messages, params), params)
        return Billed(self._cost(worker, resp), (resp.prompt_tokens, resp.completion_tokens),
                      resp.usage_estimated, key)

    def _cost(self, worker: Worker, resp: CallResponse) -> float | None:
        """The call's cost: what the server reported (a recorded cost), else tokens x price."""
        if resp.cost_usd is not None:
            return resp.cost_usd
        return call_cost(self.prices[worker.id], resp.prompt_tokens, resp.completion_tokens)

    def dead_reason(self, worker: Worker, provider) -> tuple[str, str] | None:
        """(message, kind) when every call of the worker fails for now: its key or model was
        refused, or its provider's key on another worker, which the message then says."""
        if worker.id in self._dead:
            return self._dead[worker.id]
        if provider.id in self._dead:
            msg, kind = self._dead[provider.id]
            if not msg.startswith(f"worker {worker.id} ("):
                msg = (f"worker {worker.id} ({worker.model}): not sent: provider {provider.id}'s key was "
                       f"rejected on another worker: {msg}")
            return msg, kind
        return None

    def _check_alive(self, worker: Worker, provider, attempts: int) -> None:
        """Fail now a call that cannot succeed: its key was rejected, its model is unknown,
        or its provider's limit is spent for longer than a run waits."""
        if (dead := self.dead_reason(worker, provider)) is not None:
            raise StepFailed("error", dead[0], attempts, kind=dead[1])
        held = self._held.get(provider.id)
        if held is not None:
            left = held[0] - time.monotonic()
            if left > 0:
                raise StepFailed("error", f"worker {worker.id} ({worker.model}): provider {provider.id} {held[1]} "
                                          f"{left:,.0f} s more: rerun after that", attempts, kind="rate_limit")
            del self._held[provider.id]

    def _hold(self, provider, seconds: float, said: str) -> None:
        """The provider's limit is spent for longer than a run waits: its calls fail until then."""
        why = (f"{said} {seconds:,.0f} s, longer than the {self.opt.max_wait_s:g} s a run waits; "
               f"its limit is spent for")
        self._held[provider.id] = (time.monotonic() + min(seconds, 1e9), why)

    def _observe(self, limiter, provider, rate) -> None:
        """x-ratelimit headers: paced by the limiter, unless the reset is past what a run waits."""
        if rate is None:
            return
        if rate.reset_s is not None and rate.reset_s > self.opt.max_wait_s:
            if rate.remaining < 1:
                self._hold(provider, rate.reset_s, "said its request limit resets in")
            return
        limiter.observe(rate)

    async def wait_for_governor(self, worker: Worker, f: GovernorUnavailable, since: float | None, sent: int,
                                jitter: bool = True) -> float:
        """A call the shared governor kept back sent nothing, so it waits by time, not by attempts:
        it asks again every second at most until the governor answers, or fails (StepFailed, naming
        the server) once the outage has lasted `governor_wait_s` from when this process first met it,
        or this call has waited that long.
        Counted in max_attempts, with full-jitter backoff, a 3 s outage failed a quarter of the
        calls it met. `since`: when this call was first kept back (None the first time), returned
        for its next wait. `jitter` off: the lines of one batch wait alike and go in one batch again."""
        now = time.monotonic()
        if since is None:
            since = now
        began = self.ledger.outage_since()
        # from the outage's start, or this call's own first wait if longer: a governor that answers
        # other calls now and then restarts the outage's clock, and held this call for ever
        waited = now - min(since, began if began is not None else since)
        left = self.opt.governor_wait_s - waited
        if left <= 0:
            raise StepFailed("error", f"worker {worker.id} ({worker.model}): gave up after {waited:.0f} s without "
                                      f"the shared governor: {f}", sent, kind=f.kind)
        pause = min(_GOVERNOR_POLL_S, max(self.opt.backoff_base_s, (now - since) / 2))
        if jitter:
            pause *= 0.5 + 0.5 * self._rng.random()
        # No retry (nothing was sent): the progress line counted one per call kept back, as many
        # "retries" as calls in flight for an outage that failed none. It shows the calls held instead.
        self._held_back += 1
        self._show_held_back()
        try:
            await asyncio.sleep(min(pause, left))
        finally:
            self._held_back -= 1
            self._show_held_back()
        return since

    def _show_held_back(self) -> None:
        """The calls waiting for the shared governor, on the progress line while there are any."""
        waiting = self.progress.c.waiting
        if self._held_back:
            waiting["governor"] = f"{self._held_back} call(s) held back until the shared governor answers"
        else:
            waiting.pop("governor", None)
        self.progress.tick()

    def _backoff(self, attempt: int, f: CallFailure, limiter: ProviderLimiter) -> float:
        """How long this call waits before its next attempt: what the server asked
        (Retry-After, retry-after-ms) plus up to 5%, else exponential backoff with full
        jitter. Only a 429 that says the provider's whole limit is spent (its
        x-ratelimit headers, or a litellm-reached provider whose headers we cannot see)
        holds the provider's other calls, and for no longer than asked: a one-off 429
        or 5xx waits alone, and other providers never wait."""
        if f.retry_after is not None:
            if f.kind == "rate_limit" and not f.headers_seen:
                limiter.pause(f.retry_after)
            return f.retry_after * (1 + 0.05 * self._rng.random())
        cap = min(self.opt.backoff_max_s, self.opt.backoff_base_s * 2 ** (attempt - 1))
        return cap * self._rng.random()

    def _failure_message(self, worker: Worker, provider, f: CallFailure, attempts: int) -> str:
        where = f"worker {worker.id} ({worker.model})"
        if f.kind == "auth" and (f.status == 403 or str(f).startswith("PermissionDeniedError")):
            # A key that works, without access to this model (or a refusal by policy): this
            # worker only, in the provider's words; the provider's other workers go on.
            env = provider.api_key_env
            key = f" (does the key in {env} have access to this model?)" if env else ""
            msg = f"{where}: the provider refused this worker's requests{key}: {f}"
            self._dead[worker.id] = (msg, "auth")
            return msg
        if f.kind == "auth":
            env = provider.api_key_env
            why = (f"the provider rejected the API key from environment variable {env}" if env else
                   f"the provider rejected the request's credentials ({provider.where_to_set_key()})")
            msg = f"{where}: {why} (HTTP {f.status})"
            self._dead[provider.id] = (msg, "auth")
            return msg
        if f.status == 404:
            msg = f"{where}: the provider does not know this model (HTTP 404): {f}"
            self._dead[worker.id] = (msg, "not_found")
            return msg
        if f.retry_after is not None and f.retry_after > self.opt.max_wait_s:
            return (f"{where}: the provider asked to retry in {f.retry_after:,.0f} s, longer than the "
                    f"{self.opt.max_wait_s:g} s a run waits; rerun later: {f}")
        if f.retryable:
            return f"{where}: gave up after {attempts} attempts: {f}"
        return f"{where}: {f}"

    def _run_function(self, job: PlanJob, plan: Plan, i: int, outputs: dict[int, str], path: str,
                      depth: int, worker: Worker) -> dict[str, Any]:
        step = plan.steps[i]
        if self.functions is None:
            raise StepFailed("error", f"worker {worker.id}: function workers are not available")
        t0 = time.time()
        granted = [outputs[j] for j in step.access if j in outputs]
        try:
            if job.record is not None:  # records are combined field by field
                text = combine_records(worker.function, granted)
            else:
                text = self.functions(worker.function, step, granted, job.task)
        except ValueError as e:
            raise StepFailed("error", f"worker {worker.id} ({worker.function}): {e}") from None
        entry = Entry(text, 0, 0, False, False, 0.0, time.time() - t0)
        return self._log_step(job, path, depth, step, worker=worker, status="ok", attempts=0,
                              entry=entry, cost=0.0, started=t0)

    async def _replan(self, job: PlanJob, plan: Plan, i: int, outputs: dict[int, str],
                      restored: dict[str, str], path: str, depth: int) -> dict[str, Any]:
        """A planner step: plan a sub-workflow over the outputs the step sees, run it
        at depth + 1 (paths "<path>.0", ...), and return its last output. The
        planning gets its own row at "<path>.plan" holding the sub-plan, which a
        resumed run restores instead of planning again."""
        step = plan.steps[i]
        worker = self.pool.worker(step.worker)
        if depth >= self.max_depth:
            raise StepFailed("error", f"worker {step.worker}: step {path} would re-plan at depth {depth + 1}, "
                                      f"deeper than the maximum depth {self.max_depth} (raise it with --max-depth)")
        t0 = time.time()
        prior = [(plan.steps[j].instruction, outputs[j]) for j in step.access]
        req = ReplanRequest(job, path, depth, step, worker, prior, may_replan=depth + 1 < self.max_depth)
        stored = self._sub_plans.get(job.plan_id, {}).get(req.plan_path)
        if stored is not None:
            sub = Plan.from_json(stored)
        else:
            if self.replanner is None:
                raise StepFailed("error", f"worker {step.worker}: no planner is configured for re-planning steps")
            try:
                sub = await self.replanner(self, req)
            except StepFailed as f:
                # the planning call's own row, if written, holds what it cost
                raise StepFailed(f.status, f"worker {step.worker}: re-planning step {path} failed: {f}",
                                 f.attempts, kind=f.kind, billed=f.billed if f.row is None else None) from None
            except Exception as e:  # a bad sub-plan fails this step, not the batch
                raise StepFailed("error", f"worker {step.worker}: re-planning step {path} failed: "
                                          f"{type(e).__name__}: {e}") from None
            if not req.recorded:
                info = req.info
                entry = Entry(info.get("text") or sub.to_json(), info.get("prompt_tokens") or 0,
                              info.get("completion_tokens") or 0, False, False, 0.0, time.time() - t0,
                              info.get("logprob"))
                self._log_step(job, req.plan_path, depth + 1, step, worker=worker, status="ok", attempts=0,
                               entry=entry, cost=0.0, started=t0, extra={"sub_plan": sub.to_json()},
                               model=info.get("model"))
        rows = await self.run_steps(job, sub, restored, prefix=f"{path}.", depth=depth + 1)
        failed = (next((r for r in rows if r["status"] not in ("ok", "skipped")), None)
                  or next((r for r in rows if r["status"] != "ok" and not r.get("condition_false")), None))
        last = plan_outcome(rows)
        if failed is not None or last is None:
            why = failed["error"] if failed else "no step produced an output"
            raise StepFailed(failed["status"] if failed else "error", f"sub-workflow of step {path} failed: {why}",
                             extra={"sub_plan": sub.to_json()}, kind=(failed or {}).get("failure"))
        entry = Entry(last["response_text"], 0, 0, False, False, 0.0, time.time() - t0)
        return self._log_step(job, path, depth, step, worker=worker, status="ok",
                              attempts=0, entry=entry, cost=0.0, started=t0,
                              extra={"sub_plan": sub.to_json()})

    # ---- trace rows ------------------------------------------------------

    def _claim_row(self, job, path, depth, step, worker, key, entry: Entry, t0, accept=None,
                   ended: float | None = None, out: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The row of a call this run paid for in a process killed before it logged
        the call: recorded as the paid call it was, so no spend goes missing."""
        self._paid.add(key)
        if entry.cost_usd:
            self.ledger.record(self.pool.provider_of(worker).id, entry.cost_usd)
        c = self.progress.c
        c.calls += 1
        c.usd += entry.cost_usd or 0.0
        return self._accepted_row(job, path, depth, step, worker, accept, attempts=entry.attempts,
                                  request_key=key, entry=entry, cost=entry.cost_usd, started=t0, ended=ended,
                                  out=out)

    def _cached_row(self, job, path, depth, step, worker, key, entry: Entry, t0, accept=None,
                    ended: float | None = None, out: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        self.progress.c.cache_hits += 1
        if accept is None:  # straight to the row: a rerun writes thousands of these a second
            return self._log_step(job, path, depth, step, worker=worker, status="ok", attempts=0, request_key=key,
                                  entry=entry, cost=0.0, started=t0, cache_hit=True, ended=ended, out=out)
        return self._accepted_row(job, path, depth, step, worker, accept, attempts=0,
                                  request_key=key, entry=entry, cost=0.0, started=t0, cache_hit=True,
                                  ended=ended, out=out)

    def _log_step(self, job: PlanJob, path: str, depth: int, step: Step, *, status: str,
                  worker: Worker | None = None, error: str | None = None, attempts: int = 0,
                  request_key: str | None = None, entry: Entry | None = None, cost: float | None = None,
                  started: float | None = None, ended: float | None = None, cache_hit: bool = False,
                  extra: dict[str, Any] | None = None, model: str | None = None,
                  failure: str | None = None, out: list[dict[str, Any]] | None = None,
                  tokens: tuple[int, int] | None = None, usage_estimated: bool | None = None) -> dict[str, Any]:
        """Write a step's trace row (or add it to `out`, for the caller to write with others).
        `tokens`, `usage_estimated`: a failed call's billed usage, when there is no entry."""
        worker = worker or self.pool.worker(step.worker)
        now = ended or time.time()
        if status not in ("ok", "skipped", "budget_exhausted"):  # a budget stop is no error: the rerun finishes it
            self.progress.c.errors += 1
            if (why := governor_failure_kind(error)) is not None:
                counts = self.not_sent.setdefault(why, [0, 0])
                counts[0] += 1
                counts[1] += attempts == 0  # its `attempts` are the requests it sent
        row = {
            "run_id": self.opt.run_id, "plan_id": job.plan_id, "query_id": job.query_id,
            "query_index": job.query_index, "sample": job.sample,
            "step": int(head) if (head := path.split(".", 1)[0]).isdigit() else None,  # None: a planning call
            "step_path": path, "depth": depth,
            "worker": worker.id, "model": model or worker.model, "provider": worker.provider,
            "status": status, "error": error and mask(error, *self._keys), "attempts": attempts,
            "cache_hit": cache_hit,
            "prompt_tokens": entry.prompt_tokens if entry else tokens and tokens[0],
            "completion_tokens": entry.completion_tokens if entry else tokens and tokens[1],
            "usage_estimated": entry.usage_estimated if entry else usage_estimated,
            "cost_usd": cost,
            "original_cost_usd": entry.cost_usd if entry else None,
            "latency_s": round(entry.latency_s, 6) if entry else None,
            "started_at": self._stamp(started or now), "ended_at": self._stamp(now),
            "instruction": step.instruction,
            "when": str(step.when) if step.when is not None else None,
            "response_text": entry.text if entry else None,
            "simulated": entry.simulated if entry else None,
            "request_key": request_key,
            "sub_plan": (extra or {}).get("sub_plan"),
            "failure": failure if status not in ("ok", "skipped") else None,
            "input_price": entry.input_price if entry else None,
            "output_price": entry.output_price if entry else None,
            "paid_mode": entry.paid_mode if entry else None,
        }
        if out is None:
            self._durably(self.journal.step, row)
        else:
            out.append(row)
        return row

    def log_failure(self, job: PlanJob, path: str, depth: int, step: Step, f: StepFailed,
                    worker: Worker | None = None, started: float | None = None) -> dict[str, Any]:
        """The trace row of a step that failed (written unless the failure already wrote it),
        with what its call was billed. `started`: when the step began, so the row's span shows
        the time its retries took (default: now, a span of 0 s)."""
        if f.row is not None:
            return f.row
        b = f.billed
        return self._log_step(job, path, depth, step, worker=worker, status=f.status, error=str(f),
                              attempts=f.attempts, extra=f.extra, failure=f.kind, started=started,
                              **({} if b is None else {"cost": b.cost, "tokens": b.tokens, "request_key": b.request_key,
                                                       "usage_estimated": b.estimated}))

    def _stamp(self, t: float) -> str:
        """`_ts(t)`, remembered for the last few times: rows served from the cache in
        one batch share theirs."""
        s = self._stamps.get(t)
        if s is None:
            if len(self._stamps) >= 8:
                self._stamps.clear()
            s = self._stamps[t] = _ts(t)
        return s

    def _durably(self, write: Callable[..., Any], *args: Any) -> Any:
        """A write to the journal or a cache. On a storage error the run stops sending,
        frees its reserved space, and tries the write once more: answers already paid
        for are kept when the disk fills."""
        try:
            return write(*args)
        except STORAGE_ERRORS as e:
            self._abort = self._abort or e
            if self.reserve is None:
                raise
            self.reserve.release()
            return write(*args)


def plan_outcome(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row whose output answers the plan: the last step that ran (later steps may have been
    skipped by their conditions); None if a step failed or nothing ran."""
    for r in reversed(rows):
        if r.get("condition_false"):
            continue
        return r if r["status"] == "ok" else None
    return None


def condition_holds(cond: Condition, outputs: dict[int, str], task: str | None,
                    agree: Callable[[str, str], bool] | None = None) -> tuple[bool, str]:
    """Whether a step's condition holds on the final answers of the steps it reads that ran
    (compared as the task's grader compares them; an answer that cannot be read agrees with
    nothing), and why, for the trace."""
    ran = [j for j in cond.steps if j in outputs]
    groups: list[list[int]] = []
    for j in ran:
        for g in groups:
            if (agree(outputs[g[0]], outputs[j]) if agree else answers_agree(task, outputs[g[0]], outputs[j])):
                g.append(j)
                break
        else:
            groups.append([j])
    names = ", ".join(map(str, ran))
    if cond.kind == "disagree":
        if len(groups) > 1:
            return True, f"steps {names} disagree"
        return False, f"steps {names} agree" if len(ran) > 1 else f"only step {names} ran"
    top = max((len(g) for g in groups), default=0)
    if top * 2 > len(ran):
        return False, f"{top} of steps {names} agree"
    return True, f"no majority among steps {names}"


def _ts(t: float) -> str:
    """`datetime.fromtimestamp(t, timezone.utc).isoformat()`, in 60% of its time (four per cached step)."""
    s = int(t)
    us = round((t - s) * 1e6)
    if us >= 1_000_000:
        s, us = s + 1, us - 1_000_000
    if t < 0:
        return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()
    head = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(s))
    return f"{head}.{us:06d}+00:00" if us else f"{head}+00:00"


def _interrupt(signals: list[int]) -> KeyboardInterrupt:
    import signal

    return Terminated() if signal.SIGTERM in signals else KeyboardInterrupt()
