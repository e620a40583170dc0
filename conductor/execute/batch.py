"""Provider batch APIs: the calls of a provider with `mode: batch` go out as OpenAI batch
jobs (/v1/files + /v1/batches, through litellm's file and batch functions) at the
batch price instead of one request each.

Steps that become ready together (a stage: every plan's first steps, then the steps
those answers unblock) are collected until no new request has joined for
`batch_collect_s`, then written as one JSONL input file and submitted. Cache hits
never get here (the executor answers them first). Under a budget, the worst case
of the lines that fit is reserved at submission and settled at the batch price when the
results arrive; the lines that do not fit yet wait for that and go in a later batch, and
are refused as budget_exhausted when nothing is pending and they still do not fit, or
once `batch_budget_rounds` batches have gone without them (near the cap each round fits
fewer lines, and each is a whole batch's wait).

The batch id, its input file and the request keys (custom_ids) in it are journaled
at submission (`batches.jsonl` in the work folder), so a killed run polls the same
batch on resume instead of paying for it twice. Answers are stored in the run cache
before the batch is marked done. Lines the batch did not answer (error lines, lines
left when it expired or was cancelled) go to the normal retry path: online or in a
new batch (`batch_retry`), counting attempts as online calls do. Those answered online
were paid at the online price: their trace rows say so, and the run says how many at
its end (OnlineFallback), since a scheduled run has nobody watching its progress line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from conductor.execute.batchfiles import (ENDPOINT, MAX_FILE_BYTES, BatchJournal, Waiter, batch_error,
                                          encode_line, line_result, split_by_size, unanswered)
from conductor.execute.budget import BudgetExhausted
from conductor.execute.cache import Entry
from conductor.execute.call import CallFailure, CallResponse, classify, max_prompt_tokens, redact
from conductor.execute.failure import Aborted, StepFailed
from conductor.execute.journal import count_unanswered
from conductor.execute.prices import call_cost
from conductor.execute.shared import GovernorUnavailable
from conductor.masking import mask
from conductor.pool import Provider, Worker, shown_url

if TYPE_CHECKING:
    from conductor.execute.engine import Executor

TERMINAL = ("completed", "expired", "failed", "cancelled")
# Batch API calls (upload, create, poll, download) that fail are tried this often before
# the batch's lines are handed to the retry path.
API_ATTEMPTS = 5
# litellm otherwise downloads a finished batch's whole output file a second time, in a
# logging callback, to price it with its own cost map (20 s for 5,000 lines here): we read
# the file once and price each line at the pool's price.
_NO_COST_LOG = {"litellm_metadata": {"batch_ignore_default_logging": True}}

log = logging.getLogger("conductor.batch")
# The trace note (`error` of an ok row) of a line its batch did not answer, answered online:
# "<ONLINE_NOTE>: batch <id> <how it ended>: <why>", or "<ONLINE_NOTE>: <NOT_SUBMITTED>: <why>".
ONLINE_NOTE = "answered online at the online price"
NOT_SUBMITTED = "its batch was not submitted"
_NOTE = re.compile(rf"{re.escape(ONLINE_NOTE)}: (?:batch (\S+) (\w+)|{re.escape(NOT_SUBMITTED)}): ?(.*)", re.S)
# how a batch ended, as the closing line says it: (one batch, several)
_ENDED = {"failed": ("failed", "failed"), "expired": ("expired", "expired"),
          "cancelled": ("was cancelled", "were cancelled"), "completed": ("answered them with an error",) * 2,
          "unchecked": ("could not be checked", "could not be checked")}
# Why a line was left undone by its batch's end, not by an error line of its own (its group's example)
_BY_END = ("it ended before answering it", "batch_expired (in a batch)", "batch_cancelled (in a batch)",
           "cancelled by this run")


class OnlineFallback:
    """Lines a batch did not answer (it failed, expired or was cancelled; their own error lines;
    never submitted) that were then answered online, at the online price, by how their batch
    ended. A scheduled run that paid double for them says so: one line at the end of the run
    (`said`), and in its summary (`batch_online`, from the trace notes: online_fallback)."""

    def __init__(self) -> None:
        self.lines = 0
        self.usd = 0.0
        self.ends: dict[str, dict[str, Any]] = {}  # how its batch ended -> batch ids, lines, an example

    def add(self, note: str, cost: float | None) -> None:
        m = _NOTE.match(note)
        if m is None:
            return
        bid, end, why = m.groups()
        example = " ".join(why.split())[:200]
        group = self.ends.setdefault(end or "not submitted", {"batches": set(), "lines": 0, "example": example})
        if end in ("expired", "cancelled") and example.startswith(_BY_END) \
                and not group["example"].startswith(_BY_END):
            group["example"] = example  # the batch's end, not a line that answered an error (HTTP 500)
        if bid is not None:
            group["batches"].add(bid)
        group["lines"] += 1
        self.lines += 1
        self.usd += cost or 0.0

    def summary(self) -> dict[str, Any]:
        return {"lines": self.lines, "cost_usd": round(self.usd, 9),
                "batches": sum(len(g["batches"]) for g in self.ends.values()),
                "by_end": {end: {**g, "batches": len(g["batches"])} for end, g in self.ends.items()}}

    def said(self) -> str | None:
        if not self.lines:
            return None
        parts = []
        for end, g in self.ends.items():
            n = len(g["batches"])
            if end in _ENDED:
                what = f"from {n:,} batch{'es' if n != 1 else ''} that {_ENDED[end][n != 1]}"
            else:
                what = "whose batch could not be submitted"
            # a batch that could not be checked may have run all the same: its lines may be paid twice
            twice = (": the provider may have billed them in the batch too (counted in `lost in flight`)"
                     if end == "unchecked" else "")
            parts.append(f"{g['lines']:,} {what} (e.g. {g['example'].rstrip('.')}){twice}")
        return (f"batch lines answered online at the online price: {self.lines:,} (${self.usd:.6f}), as their "
                f"batches did not answer them: {'; '.join(parts)}. Their trace rows say so in `error`; with "
                f"batch_retry: batch such lines wait for a new batch instead")


def online_fallback(traces: Path) -> dict[str, Any]:
    """The run's lines answered online after their batch did not answer them, from its traces'
    notes (every command that worked on the run): for the run's summary. An answer then refused
    (enrichment: no valid record) keeps the note before its error, and counts as the closing line
    counted it: paid online all the same."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    t = pq.read_table(traces, columns=["error", "cost_usd"])
    t = t.filter(pc.fill_null(pc.starts_with(t.column("error"), ONLINE_NOTE), False))
    tally = OnlineFallback()
    for note, cost in zip(t.column("error").to_pylist(), t.column("cost_usd").to_pylist()):
        tally.add(note, cost)
    return tally.summary()


@dataclass
class OpenBatch:
    """A submitted batch (this run's, or one journaled by a killed process) and the steps
    waiting for its lines."""

    record: dict[str, Any]  # as journaled: batch_id, input_file_id, worker, keys, reserved, at
    waiters: dict[str, Waiter] = field(default_factory=dict)
    task: asyncio.Task | None = None
    reservation: Any = None
    status: str = "submitted"
    outage_since: float | None = None  # when checking it began to fail, until it answers again
    why_ended: str = ""  # why none of its lines were answered, if one reason holds for all (failed, cancelled)

    @property
    def batch_id(self) -> str:
        return self.record["batch_id"]


class Batches:
    """The executor's batch path for providers with `mode: batch`."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.journal = BatchJournal(ex.journal.folder)
        # A batch handed over by an abandoned run (adopted_from) may name a worker this pool lacks: left alone.
        opened = {b: r for b, r in self.journal.open.items() if ex.pool.has(r["worker"])}
        uploaded = {f: r for f, r in self.journal.uploaded.items() if ex.pool.has(r["worker"])}
        self._open: dict[str, OpenBatch] = {b: OpenBatch(r) for b, r in opened.items()}
        self._by_key: dict[str, str] = {k: b for b, r in opened.items() for k in r["keys"]}
        self._unconfirmed: dict[str, str] = {k: f for f, r in uploaded.items() for k in r["keys"]}
        self._lookups: dict[str, asyncio.Task] = {}  # input file id -> finding its batch
        self._pending: dict[tuple[str, str | None], list[tuple[str, Waiter]]] = {}
        self._collectors: dict[tuple[str, str | None], asyncio.Task] = {}
        self._asking: dict[tuple[str, str | None], float] = {}  # collected, not yet reserved: worst case
        self._told: set[str] = set()  # workers whose lines have waited for budget room (said once)
        self._tasks: set[asyncio.Task] = set()
        self.submissions = 0  # batches this run submitted
        self._left: dict[str, str] = {}  # request key -> how its batch left it unanswered (for the online note)
        self.online = OnlineFallback()

    # ---- the step's side ---------------------------------------------------

    async def call(self, worker: Worker, messages: list[dict[str, str]], params: dict[str, Any],
                   key: str) -> tuple[CallResponse, int, float]:
        """One step's call through the batch API: (response, attempts, latency); raises StepFailed.
        `attempts`, there as for an online call, counts the requests sent: a line whose batch was
        never submitted (the upload failed) was not sent, though it counts towards max_attempts; a
        line the shared governor kept back waits for it by time (Executor.wait_for_governor)."""
        ex = self.ex
        provider = ex.pool.provider_of(worker)
        if (dead := ex.dead_reason(worker, provider)) is not None:
            raise StepFailed("error", dead[0], kind=dead[1])
        worst = self._worst(worker, provider, messages, params)
        t0 = time.monotonic()
        attempts = sent = 0
        kept_back: float | None = None
        while True:
            waiter = Waiter(worker, messages, params, asyncio.get_running_loop().create_future(), worst)
            bid = self._by_key.get(key) if attempts == 0 else None
            if bid is None and attempts == 0 and key in self._unconfirmed:
                bid = await self._confirm(self._unconfirmed[key], worker, provider)
            if bid is not None and bid in self._open:  # journaled by a killed run: poll that batch
                self._attach(self._open[bid], key, waiter)
            else:
                self._enqueue(worker, provider, key, waiter)
            try:
                resp = await waiter.future
                return resp, sent + 1, time.monotonic() - t0
            except StepFailed as f:  # refused before its batch went (budget): after earlier tries
                if sent and f.attempts != sent:
                    raise StepFailed(f.status, str(f), sent, f.extra, f.kind, f.row, f.billed) from None
                raise
            except CallFailure as f:
                left = self._left.pop(key, None)
                if isinstance(f, GovernorUnavailable) and f.retryable:  # its batch never went: a new one
                    kept_back = await ex.wait_for_governor(worker, f, kept_back, sent, jitter=False)
                    continue  # not online (at twice the price); waiting alike, its lines go in one batch again
                attempts += 1
                sent += waiter.sent
                if not f.retryable or attempts >= provider.max_attempts or f.charged is not None:
                    raise StepFailed("error", ex._failure_message(worker, provider, f, attempts), sent,
                                     kind="not_found" if f.status == 404 else f.kind, billed=f.charged) from None
                ex.progress.c.retries += 1
                if provider.batch_retry == "online":
                    resp, n, latency = await ex._call_with_retries(worker, messages, params, key,
                                                                   attempts_before=attempts, sent_before=sent)
                    return self._answered_online(left or f"{NOT_SUBMITTED}: {f}", worker, resp), n, latency

    def _answered_online(self, left: str, worker: Worker, resp: CallResponse) -> CallResponse:
        """A line its batch did not answer, answered online at the online price: counted (one line
        at the end of the run) and noted in its trace row's `error`, as a usage warning is."""
        note = f"{ONLINE_NOTE}: {left}"
        self.online.add(note, self.ex._cost(worker, resp))
        return replace(resp, warning=note if resp.warning is None else f"{note}; {resp.warning}")

    def _worst(self, worker: Worker, provider: Provider, messages: list[dict[str, str]],
               params: dict[str, Any]) -> float:
        """The request's worst-case cost at the batch price (0 when no budget applies)."""
        if provider.id not in self.ex._budgeted:
            return 0.0
        worst = self._priced_worst(worker, provider, messages, params)
        if worst is None:
            raise StepFailed("error", f"worker {worker.id}: no known price for model {worker.model}, so it "
                                      f"cannot run under a budget; add price: {{input_per_mtok, "
                                      f"output_per_mtok}} to it in the pool file", kind="config")
        return worst

    def _priced_worst(self, worker: Worker, provider: Provider, messages: list[dict[str, str]],
                      params: dict[str, Any]) -> float | None:
        """The request's worst-case cost at the batch price, budget or not (None: no known price)."""
        price = self.ex.prices[worker.id]
        if price is None:
            return None
        online = max_prompt_tokens(messages, params) * price.input + params["max_tokens"] * price.output
        return online * provider.batch_price_factor

    def _count_unchecked(self, batch: OpenBatch, worker: Worker, provider: Provider) -> None:
        """A batch that could not be checked (its output file would not download, say) may have run
        and been billed: its lines count as lost in flight at their worst case, as a cut-off online
        call does, so that the run's summary explains the budgets' charge above its cost."""
        lost = self.ex.unanswered
        keys = batch.record["keys"]
        reserved = batch.record.get("reserved") or 0.0
        if reserved:  # the worst case of every line, as reserved at submission
            lost["calls"] = lost.get("calls", 0) + len(keys)
            lost["reserved_usd"] = lost.get("reserved_usd", 0.0) + reserved
            return
        for key in keys:  # no budget: priced from the waiting steps (a line none waits for: no known price)
            w = batch.waiters.get(key)
            count_unanswered(lost, None if w is None else self._priced_worst(worker, provider, w.messages, w.params))

    def _enqueue(self, worker: Worker, provider: Provider, key: str, waiter: Waiter) -> None:
        group = (worker.id, self._api_key(provider, worker))
        self._pending.setdefault(group, []).append((key, waiter))
        if group not in self._collectors:
            self._collectors[group] = self._spawn(self._collect(group, worker, provider))

    def _attach(self, batch: OpenBatch, key: str, waiter: Waiter) -> None:
        waiter.sent = True  # a batch a killed run submitted: its line went
        batch.waiters[key] = waiter
        if batch.task is None:
            worker = self.ex.pool.worker(batch.record["worker"])
            batch.task = self._spawn(self._resume(batch, worker, self.ex.pool.provider_of(worker)))

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Stop polling (the run is over or aborted; open batches stay journaled for a resume)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            try:
                await task
            except BaseException:  # noqa: BLE001 - cancelled, or already reported to its steps
                pass
        self.journal.close()
        if (said := self.online.said()) is not None:  # loud: a scheduled run has nobody watching
            log.warning("%s", mask(said, *self.ex._keys))

    # ---- collecting and submitting ---------------------------------------

    async def _collect(self, group: tuple[str, str | None], worker: Worker, provider: Provider) -> None:
        """Wait until no new request joins the group for batch_collect_s (or it is full), then submit it."""
        seen = -1
        try:
            while len(self._pending[group]) != seen and len(self._pending[group]) < provider.batch_max_requests:
                seen = len(self._pending[group])
                await asyncio.sleep(provider.batch_collect_s)
        finally:
            del self._collectors[group]
            lines = self._pending.pop(group)
        rest = lines[provider.batch_max_requests:]
        if rest:
            self._pending[group] = rest
            self._collectors[group] = self._spawn(self._collect(group, worker, provider))
        model = worker.model.split("/", 1)[1]
        encoded = [(key, w, encode_line(model, key, w)) for key, w in lines[:provider.batch_max_requests]]
        self._asking[group] = sum(w.worst for _, w, _ in encoded)  # a rival of other groups until reserved
        # one input file per MAX_FILE_BYTES (OpenAI refuses larger files), submitted side by side
        await asyncio.gather(*(self._submit(part, worker, provider, group[1])
                               for part in split_by_size(encoded, MAX_FILE_BYTES)))

    async def _submit(self, lines: list[tuple[str, Waiter, bytes]], worker: Worker, provider: Provider,
                      api_key: str | None) -> None:
        """Reserve, upload, create and journal one batch, then follow it to its answers."""
        ex = self.ex
        reservation = None
        try:
            if ex._abort is not None:
                raise Aborted()
            lines, reservation = await self._reserve(lines, worker, provider)
            if not lines:
                return
            data = b"".join(line for _, _, line in lines)
            litellm = _litellm()
            where = self._where(worker, provider, api_key)
            file = await self._api(provider, "upload the batch input file", lambda: litellm.acreate_file(
                file=("conductor-batch.jsonl", data, "application/jsonl"), purpose="batch", **where))
            record = {"batch_id": None, "input_file_id": file.id, "worker": worker.id,
                      "keys": [k for k, _, _ in lines], "reserved": reservation.amount if reservation else 0.0,
                      "at": time.time()}
            ex._durably(self.journal.uploaded_file, record)
            # A create that timed out may have created the batch: look for it before trying again.
            made = await self._api(provider, "create the batch", lambda: litellm.acreate_batch(
                completion_window=provider.batch_completion_window, endpoint=ENDPOINT, input_file_id=file.id,
                metadata={"conductor_run": ex.opt.run_id}, **where),
                before_retry=lambda: self._find(file.id, where, provider))
        except CallFailure as f:
            if f.kind == "client":  # the batch itself refused (its options, the endpoint), not a line
                f = CallFailure("batch_refused", f"{f}; no line of it ran: check provider {provider.id}'s "
                                                 f"batch_* options in the pool file, then rerun",
                                f.status)
            for _, w, _ in lines:
                _fail(w.future, f)
            if reservation is not None:
                await ex.ledger.settle(reservation, 0.0)
            return
        except asyncio.CancelledError:
            for _, w, _ in lines:
                _fail(w.future, Aborted())
            raise
        except Exception as e:  # a storage error (the run stops) or a bug: these lines fail, not the run
            for _, w, _ in lines:
                _fail(w.future, e)
            if reservation is not None:
                await ex.ledger.settle(reservation, 0.0)
            return
        record["batch_id"] = made.id
        for _, w, _ in lines:
            w.sent = True
        batch = OpenBatch(record, {key: w for key, w, _ in lines}, reservation=reservation)
        self._open[made.id] = batch
        self.submissions += 1
        ex.progress.c.requests += len(lines)
        batch.task = asyncio.current_task()
        await self._follow(batch, worker, provider, lambda: ex._durably(self.journal.submitted, record))

    async def _reserve(self, lines: list[tuple[str, Waiter, bytes]], worker: Worker,
                       provider: Provider) -> tuple[list[tuple[str, Waiter, bytes]], Any]:
        """Reserve the worst case of the lines that fit in the budget now, and send those.
        Worst cases are several times the real cost, so the rest wait for pending reservations
        to settle and go in a later batch, as an online call waits; a line is refused
        (budget_exhausted) when it could not fit even once they settled, or nothing is pending,
        or batch_budget_rounds of its worker's batches went without it."""
        ex = self.ex
        group = (worker.id, self._api_key(provider, worker))
        self._asking.pop(group, None)
        if provider.id not in ex._budgeted:
            return lines, None
        lines = sorted(lines, key=lambda line: -line[1].left_out)  # the longest waiting first
        free = ex.ledger.free(provider.id)
        rivals = self._rivals(group, provider)
        # A fair share, so that every worker's batch of a stage goes out now, side by side
        share = max(free / (1 + len(rivals)), free - sum(rivals))
        take, rest = _fitting(lines, share)
        if not take:
            take, rest = _fitting(lines, free)
        reservation, last = None, None
        while take:
            try:
                reservation = await ex.ledger.reserve(provider.id, sum(w.worst for _, w, _ in take))
                break
            except BudgetExhausted as e:  # a cap not kept in this process (a shared governor's)
                last = e
                fit, over = _fitting(take, e.limit - e.spent)
                if not over:  # it did not fit as a whole: one line fewer
                    over = [fit.pop()]
                take, rest = fit, over + rest
            except GovernorUnavailable as e:  # nothing sent: call() waits for the governor by time, then again
                for _, w, _ in lines:
                    _fail(w.future, e)
                return [], None
        pending = reservation is not None or ex.ledger.pending(provider.id)
        later = []
        for line in rest:
            waiter = line[1]
            why = ex.ledger.refusal(provider.id, waiter.worst)
            waiter.left_out += reservation is not None
            if why is None and pending:
                if waiter.left_out < provider.batch_budget_rounds:
                    later.append(line)
                    continue
                why = self._too_many_rounds(waiter, provider)
            why = why or last or "budget exhausted"
            _fail(waiter.future, StepFailed("budget_exhausted", f"worker {worker.id}: {why}", kind="budget"))
        if later:
            if reservation is not None and worker.id not in self._told:
                self._told.add(worker.id)
                ex.progress.say(f"worker {worker.id}: the budget has room now for the worst case of {len(take)} "
                                f"of {len(lines)} batch lines; the rest wait for batches to end (a line left "
                                f"out of {provider.batch_budget_rounds} is refused: batch_budget_rounds). Worst cases "
                                f"(prompt bytes + max_tokens) stay reserved until a batch ends, so a lower "
                                f"max_tokens or a larger budget means fewer rounds")
            self._spawn(self._hold(later, worker, provider, ex.ledger.settles))
        return take, reservation

    def _too_many_rounds(self, waiter: Waiter, provider: Provider) -> str:
        """Why a line that fits once batches end is refused anyway: each round is a batch's
        wait (hours at a provider), and near the cap rounds shrink without end."""
        return (f"left out of {waiter.left_out} of its batches for want of budget room (batch_budget_rounds "
                f"{provider.batch_budget_rounds}): each batch holds its lines' worst cases (${waiter.worst:.6f} "
                f"here: prompt bytes + max_tokens {waiter.params['max_tokens']}) until it ends. Lower max_tokens, "
                f"or raise the budget or batch_budget_rounds, and rerun")

    def _rivals(self, group: tuple[str, str | None], provider: Provider) -> list[float]:
        """The worst cases of the other workers' batches being collected or about to be
        reserved that draw on the same caps."""
        ex = self.ex
        asking = dict(self._asking)
        for g, pending in self._pending.items():
            asking[g] = asking.get(g, 0.0) + sum(w.worst for _, w in pending)
        out = []
        for g, worst in asking.items():
            other = ex.pool.provider_of(ex.pool.worker(g[0])).id
            shared = other == provider.id or (ex.opt.run_budget_usd is not None and other in ex._budgeted)
            if g != group and worst > 0 and shared:
                out.append(worst)
        return out

    async def _hold(self, lines: list[tuple[str, Waiter, bytes]], worker: Worker, provider: Provider,
                    seen: int) -> None:
        """Lines the budget cannot cover yet: back in the queue once a reservation settles
        (or failed if the run stops first: a stopped batch's reservation never settles)."""
        while self.ex._abort is None:
            try:
                await asyncio.wait_for(self.ex.ledger.settled_since(seen), provider.batch_poll_s)
            except asyncio.TimeoutError:
                continue
            except asyncio.CancelledError:
                for _, w, _ in lines:
                    _fail(w.future, Aborted())
                raise
            for key, w, _ in lines:
                if not w.future.done():
                    self._enqueue(worker, provider, key, w)
            return
        for _, w, _ in lines:
            _fail(w.future, Aborted())

    # ---- waiting and answers ---------------------------------------------

    async def _resume(self, batch: OpenBatch, worker: Worker, provider: Provider) -> None:
        """Poll a batch a killed run submitted; its worst case is reserved again meanwhile."""
        if provider.id in self.ex._budgeted and batch.record.get("reserved"):
            try:
                batch.reservation = await self.ex.ledger.reserve(provider.id, batch.record["reserved"])
            except (BudgetExhausted, GovernorUnavailable):
                batch.reservation = None  # already submitted: its answers are paid for either way
        await self._follow(batch, worker, provider)

    async def _follow(self, batch: OpenBatch, worker: Worker, provider: Provider, first: Any = None) -> None:
        """Wait for the batch; whatever goes wrong on the way fails its waiting steps (never leaves
        them waiting): a storage error stops the run, anything else fails those steps only."""
        try:
            if first is not None:
                first()
            await self._wait(batch, worker, provider)
        except asyncio.CancelledError:
            for w in batch.waiters.values():
                _fail(w.future, Aborted())
            raise
        except Exception as e:
            self._forget(batch)
            for w in batch.waiters.values():
                _fail(w.future, e)
            if batch.reservation is not None:
                await self.ex.ledger.settle(batch.reservation, batch.record.get("reserved", 0.0))

    def _forget(self, batch: OpenBatch) -> None:
        """No step waits on this batch any more (answered, or given up)."""
        self._open.pop(batch.batch_id, None)
        for key in batch.record["keys"]:
            if self._by_key.get(key) == batch.batch_id:
                del self._by_key[key]

    async def _wait(self, batch: OpenBatch, worker: Worker, provider: Provider) -> None:
        ex = self.ex
        litellm = _litellm()
        where = self._where(worker, provider, self._api_key(provider, worker))
        bid = batch.batch_id
        cancelled = False
        try:
            while True:
                if ex._abort is not None:  # the run stops; the batch stays journaled for a resume
                    for w in batch.waiters.values():
                        _fail(w.future, Aborted())
                    return
                try:
                    info = await self._api(provider, f"check batch {bid}",
                                           lambda: litellm.aretrieve_batch(batch_id=bid, **where, **_NO_COST_LOG))
                except CallFailure as f:
                    if f.status == 404:
                        raise CallFailure("server", f"batch {bid} is unknown to the provider: {f}") from None
                    if not f.retryable or time.time() - batch.record["at"] > provider.batch_max_wait_s:
                        raise
                    self._unreachable(batch, worker, provider, f)
                    await asyncio.sleep(provider.batch_poll_s)  # the batch is paid for: keep asking
                    continue
                if batch.outage_since is not None:
                    ex.progress.say(f"batch {bid}: the provider answers again after "
                                    f"{time.time() - batch.outage_since:.0f} s")
                    batch.outage_since = None
                batch.status = info.status
                self._show(batch, info)
                if info.status in TERMINAL:
                    break
                if not cancelled and time.time() - batch.record["at"] > provider.batch_max_wait_s:
                    cancelled = True  # its answered lines still come back; the rest are retried
                    await self._api(provider, f"cancel batch {bid}",
                                    lambda: litellm.acancel_batch(batch_id=bid, **where))
                    continue
                await asyncio.sleep(provider.batch_poll_s)
            lines: dict[str, CallResponse | CallFailure] = {}  # read as they come: no file held whole
            for file_id in (info.output_file_id, info.error_file_id):
                if file_id:
                    content = await self._api(provider, f"download file {file_id} of batch {bid}",
                                              lambda: litellm.afile_content(file_id=file_id, **where))
                    for line in content.content.splitlines():
                        try:
                            row = orjson.loads(line)
                        except orjson.JSONDecodeError:
                            continue  # an unreadable line: its request counts as unanswered
                        key = row.get("custom_id") if isinstance(row, dict) else None
                        if key is not None and not isinstance(lines.get(key), CallResponse):
                            lines[key] = line_result(row, batch.waiters.get(key), where["api_key"])
                    del content
        except CallFailure as f:  # the batch cannot be followed: its lines take the retry path
            batch.why_ended = str(f)
            self._finish(batch, {}, f"batch {bid}: {f}", None, provider)
            if batch.reservation is not None:  # the provider may still run it: counted as spent
                await ex.ledger.settle(batch.reservation, batch.record.get("reserved", 0.0))
            self._count_unchecked(batch, worker, provider)
            return
        finally:
            self._show(batch, None)
        why = redact(batch_error(info) or f"batch {bid} ended {info.status} before answering this request",
                     where["api_key"])
        if info.status == "failed":
            batch.why_ended = why.removeprefix(f"batch {bid} failed: ")
        elif info.status == "cancelled" and cancelled:  # not at the request: it may still end completed
            batch.why_ended = f"cancelled by this run after batch_max_wait_s ({provider.batch_max_wait_s:g} s)"
        self._finish(batch, lines, why, info.status, provider)
        if batch.reservation is not None:
            await ex.ledger.settle(batch.reservation, batch.record.get("paid", 0.0))

    def _finish(self, batch: OpenBatch, lines: dict[str, CallResponse | CallFailure], why: str,
                status: str | None, provider: Provider) -> None:
        """Store every answer in the run cache, mark the batch done, then hand each waiting
        step its answer or its line's failure."""
        ex = self.ex
        worker = ex.pool.worker(batch.record["worker"])
        latency = time.time() - batch.record["at"]
        results: dict[str, CallResponse | CallFailure] = {}
        paid = 0.0
        for key in batch.record["keys"]:
            waiter = batch.waiters.get(key)
            got = lines.get(key) or unanswered(why, status)
            if isinstance(got, CallResponse):
                if waiter is not None:
                    got = ex._clamped(got, max_prompt_tokens(waiter.messages, waiter.params), waiter.params)
                price = ex.prices[worker.id]
                cost = call_cost(price, got.prompt_tokens, got.completion_tokens)
                cost = None if cost is None else cost * provider.batch_price_factor
                got = replace(got, cost_usd=cost)
                if ex.run_cache is not None:  # kept before the batch is marked done: it is paid for
                    ex._durably(ex.run_cache.put, key, worker.model, Entry(
                        got.text, got.prompt_tokens, got.completion_tokens, got.usage_estimated, got.simulated,
                        cost, latency, got.logprob, 1, None if price is None else price.input,
                        None if price is None else price.output, "batch"))
                if waiter is not None:  # an answer no step waits for is counted when a step claims it
                    paid += cost or 0.0
                    if batch.reservation is None and cost:
                        ex.ledger.record(provider.id, cost)
            elif isinstance(got, CallFailure) and waiter is not None:
                self._left[key] = (f"batch {batch.batch_id} {status or 'unchecked'}: "
                                   f"{batch.why_ended or (got if key in lines else 'it ended before answering it')}")
                billed = ex._billed(worker, got, waiter.messages, waiter.params, key)
                if billed is not None:  # an answer that cannot be kept, billed all the same
                    cost = None if billed.cost is None else billed.cost * provider.batch_price_factor
                    got.charged = replace(billed, cost=cost)
                    paid += cost or 0.0
                    ex.progress.c.usd += cost or 0.0
                    if batch.reservation is None and cost:
                        ex.ledger.record(provider.id, cost)
            results[key] = got
        batch.record["paid"] = paid
        if ex.run_cache is not None:
            ex._durably(ex.run_cache.flush)
        if status is not None:
            ex._durably(self.journal.done, batch.batch_id, status)
        self._forget(batch)
        for key, waiter in batch.waiters.items():
            got = results.get(key)
            if isinstance(got, CallResponse):
                if not waiter.future.done():
                    waiter.future.set_result(got)
            else:
                _fail(waiter.future, got or CallFailure("server", why))

    async def _api(self, provider: Provider, what: str, send: Any, before_retry: Any = None) -> Any:
        """One batch-API call, tried up to API_ATTEMPTS times on retryable failures;
        `before_retry()` may return the call's result after all (a batch created by a
        request whose answer was lost)."""
        for attempt in range(1, API_ATTEMPTS + 1):
            if attempt > 1 and before_retry is not None and (found := await before_retry()) is not None:
                return found
            try:
                return await asyncio.wait_for(send(), provider.timeout_s)
            except asyncio.TimeoutError:
                f = CallFailure("timeout", f"no answer within timeout_s={provider.timeout_s:g} s")
            except Exception as e:  # litellm maps provider errors onto many classes
                f = classify(e, os.environ.get(provider.api_key_env) if provider.api_key_env else None)
            if not f.retryable or attempt == API_ATTEMPTS:
                raise CallFailure(f.kind, f"could not {what}: {f}", f.status, f.retry_after)
            await asyncio.sleep(f.retry_after if f.retry_after is not None
                                else min(30.0, self.ex.opt.backoff_base_s * 2 ** attempt))

    async def _confirm(self, file_id: str, worker: Worker, provider: Provider) -> str | None:
        """The batch a killed run created from this input file without journaling it, if the
        provider has one (then it is polled like any journaled batch); None: submit anew."""
        if file_id not in self._lookups:
            self._lookups[file_id] = self._spawn(self._adopt(file_id, worker, provider))
        return await asyncio.shield(self._lookups[file_id])

    async def _adopt(self, file_id: str, worker: Worker, provider: Provider) -> str | None:
        record = self.journal.uploaded[file_id]
        where = self._where(self.ex.pool.worker(record["worker"]), provider, self._api_key(provider, worker))
        found = await self._find(file_id, where, provider)
        for key in record["keys"]:
            self._unconfirmed.pop(key, None)
        if found is None:
            self.ex._durably(self.journal.not_created, file_id)
            return None
        record = {**record, "batch_id": found.id}
        record.pop("event", None)
        record.pop("_seq", None)
        self.ex._durably(self.journal.submitted, record)
        self._open[found.id] = OpenBatch(record)
        for key in record["keys"]:
            self._by_key[key] = found.id
        return found.id

    async def _find(self, file_id: str, where: dict[str, Any], provider: Provider) -> Any:
        """The provider's batch made from this input file (newest first, a few pages), or None."""
        litellm = _litellm()
        after = None
        for _ in range(10):
            try:
                page = await asyncio.wait_for(litellm.alist_batches(after=after, limit=100, **where),
                                              provider.timeout_s)
            except Exception:  # noqa: BLE001 - cannot tell: treat as not created (may pay twice, never loses)
                return None
            data = getattr(page, "data", None) or (page.get("data") if isinstance(page, dict) else None) or []
            for b in data:
                if (getattr(b, "input_file_id", None) or (b.get("input_file_id") if isinstance(b, dict) else None)) \
                        == file_id:
                    return b
            more = getattr(page, "has_more", None) if not isinstance(page, dict) else page.get("has_more")
            if not more or not data:
                return None
            last = data[-1]
            after = getattr(last, "id", None) or (last.get("id") if isinstance(last, dict) else None)
        return None

    def _where(self, worker: Worker, provider: Provider, api_key: str | None) -> dict[str, Any]:
        return {"custom_llm_provider": "openai", "api_base": worker.api_base, "api_key": api_key,
                "timeout": provider.timeout_s, "max_retries": 0}

    def _api_key(self, provider: Provider, worker: Worker) -> str | None:
        key = os.environ.get(provider.api_key_env) if provider.api_key_env else None
        if key is None and worker.api_base:
            key = "no-key"  # OpenAI-compatible local servers need some value
        return key

    def _unreachable(self, batch: OpenBatch, worker: Worker, provider: Provider, f: CallFailure) -> None:
        """A provider that stops answering while it runs a batch is said, once, and shown on the
        progress line while it lasts: it used to be retried in silence for up to a day."""
        waited = int(time.time() - batch.record["at"])
        left = max(0, int(provider.batch_max_wait_s - waited))
        self.ex.progress.c.waiting[batch.batch_id] = (
            f"batch {batch.batch_id} cannot be checked ({f.kind}) after {waited // 60}m{waited % 60:02d}s")
        if batch.outage_since is None:
            batch.outage_since = time.time()
            self.ex.progress.say(f"batch {batch.batch_id} of worker {worker.id}: cannot check it at "
                                 f"{shown_url(worker)} ({' '.join(str(f).split())[:200]}); asking again "
                                 f"every {provider.batch_poll_s:g} s for up to {left} s (batch_max_wait_s)")
        self.ex.progress.tick()

    def _show(self, batch: OpenBatch, info: Any) -> None:
        """The batch's state on the progress line, so a long wait is visible."""
        waiting = self.ex.progress.c.waiting
        if info is None:
            waiting.pop(batch.batch_id, None)
        else:
            counts = getattr(info, "request_counts", None)
            done = getattr(counts, "completed", 0) or 0
            failed = getattr(counts, "failed", 0) or 0
            total = getattr(counts, "total", 0) or len(batch.record["keys"])
            waited = int(time.time() - batch.record["at"])
            waiting[batch.batch_id] = (f"batch {batch.batch_id} {info.status} {done}/{total}"
                                       + (f" ({failed} failed)" if failed else "")
                                       + f" after {waited // 60}m{waited % 60:02d}s")
        self.ex.progress.tick()


def _fitting(lines: list[tuple[str, Waiter, bytes]], room: float) -> tuple[list, list]:
    """(the lines whose worst cases fit in `room`, taken in order, skipping those that do
    not; the others)."""
    fit, over, acc = [], [], 0.0
    for line in lines:
        if acc + line[1].worst <= room:
            fit.append(line)
            acc += line[1].worst
        else:
            over.append(line)
    return fit, over


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _litellm() -> Any:
    from conductor.execute.call import _litellm as load

    return load()
