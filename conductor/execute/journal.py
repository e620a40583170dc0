"""The run journal: every finished step and plan, appended as one JSON line the
moment it finishes. A run killed at any point restarts from it: finished plans
are skipped, finished steps of unfinished plans are restored, and what was
paid is counted against the budget again.

Inside an event loop, the step and plan lines of one loop turn are written
together right after it (one write instead of one per line); reservations are
written at once, before their request is sent. What reaches the OS survives a
killed process (not a power cut); a kill loses at most the last turn's lines,
whose answers the run cache holds (committed before a step line is written), so
a resume records them as paid. A line torn by a kill is cut off on reopening. A failed write is raised
by the next write (or `flush`), after which every line is written at once. A
finished plan whose step lines are missing (a damaged line deleted by hand, as
the refusal advises) runs again, its answers taken from the run cache.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

import orjson

from conductor.errors import ConductorError
from conductor.execute.shared.url import failed_on_governor
from conductor.execute.turns import AfterTurn

# Statuses that end a plan for good; others (budget_exhausted) are retried on resume.
FINAL_PLAN_STATUSES = {"ok", "error", "invalid_plan", "invalid"}  # invalid: no valid record
# Failure kinds of an `error` plan that a rerun retries anyway (a provider back up, a
# larger budget), at most RETRY_TRANSIENT times; other errors stay final unless
# retry_failed (`--retry-failed`).
# batch_refused: a provider refused to create a batch (a pool option it does not take): nothing ran
TRANSIENT_KINDS = {"rate_limit", "server", "timeout", "connection", "budget", "batch_refused"}
RETRY_TRANSIENT = 3
STEPS_FILE = "steps.jsonl"
PLANS_FILE = "plans.jsonl"
# Every call is journaled (with its worst-case USD, a reservation under a budget) before its request
# is sent and settled when it ends, so a process killed with calls in flight leaves unsettled lines,
# counted on resume as spent and as lost in flight.
RESERVATIONS_FILE = "reservations.jsonl"


@dataclass
class ResumeState:
    finished: set[str] = field(default_factory=set)  # plan ids with a final status
    outputs: dict[str, dict[str, str]] = field(default_factory=dict)  # plan id -> step path -> output
    spent: dict[str, float] = field(default_factory=dict)  # provider -> USD already paid
    # plan id -> step path -> the sub-workflow (JSON) a re-planning step wrote, so a
    # resumed run runs the same sub-workflow instead of planning it again
    sub_plans: dict[str, dict[str, str]] = field(default_factory=dict)
    # request keys whose paid call has a row; a run-cache answer for any other key
    # was paid by a process killed before it logged the call
    paid: set[str] = field(default_factory=set)
    steps_logged: int = 0
    # plan ids whose latest row is invalid_plan: run again when their plan became valid since
    # (`--retry-failed` asked the LLM planner again for a plan whose planning call had failed)
    invalid: set[str] = field(default_factory=set)
    # reservation id -> (request key, provider, USD reserved or None) of calls sent by a process that never
    # settled them
    unsettled: dict[str, tuple[str, str, float | None]] = field(default_factory=dict)
    # finished plans run again because step lines of theirs are missing (load_state's _Gaps):
    # plan id -> the step paths not restored from the journal
    gaps: dict[str, frozenset[str]] = field(default_factory=dict)


class Journal:
    def __init__(self, folder: Path, answers_first: Callable[[], None] | None = None):
        """`answers_first`: commits the run cache; called before step lines are written, so
        a step line that says a call was paid never reaches the disk before its answer does
        (else a kill between the two leaves a paid call a resume cannot serve, and sends again)."""
        self.folder = folder
        self._answers_first = answers_first
        folder.mkdir(parents=True, exist_ok=True)
        self._steps = _open_append(folder / STEPS_FILE)
        self._plans = _open_append(folder / PLANS_FILE)
        self._reservations = _open_append(folder / RESERVATIONS_FILE)
        self._pending: dict[int, list[bytes]] = {id(self._steps): [], id(self._plans): []}
        # reservations too: a paid row's call is its key's latest reservation before it (_read_reservations)
        self._seq = _last_seq(folder / STEPS_FILE, folder / PLANS_FILE, folder / RESERVATIONS_FILE)
        # the cache's errors too: its commit runs first (answers_first)
        self._turn = AfterTurn(self.flush, (OSError, sqlite3.DatabaseError))

    def step(self, row: dict[str, Any]) -> None:
        self._queue(self._steps, row)

    def plan(self, row: dict[str, Any]) -> None:
        self._queue(self._plans, row)

    def steps(self, rows: list[dict[str, Any]]) -> None:
        """Several step rows at once (a batch served from the cache)."""
        self._queue(self._steps, *rows)

    def plans(self, rows: list[dict[str, Any]]) -> None:
        self._queue(self._plans, *rows)

    def _queue(self, f: IO[bytes], *rows: dict[str, Any]) -> None:
        self._turn.raise_pending()
        pending = self._pending[id(f)]
        for row in rows:
            row["_seq"] = self._next_seq()
            pending.append(orjson.dumps(row) + b"\n")
        self._turn.schedule()

    def flush(self) -> None:
        """Write the queued lines (raises a failed write's error; the lines stay queued)."""
        self._turn.raise_pending()
        if self._answers_first is not None and self._pending[id(self._steps)]:
            self._answers_first()
        # Steps before plans: a plan's line never reaches the disk before its steps' lines,
        # which the object store's journal snapshots rely on (objects.WORK_FILES).
        for f in (self._steps, self._plans):
            lines = self._pending[id(f)]
            if lines:
                _write_bytes(f, b"".join(lines))
                lines.clear()

    def _next_seq(self) -> int:
        """The wall clock in ns, but never at or below the journal's last line: _Gaps orders a plan's
        lines by it, and a clock stepped back between commands made an intact plan look short of
        step lines (run again; a failed step sent and paid again)."""
        self._seq = max(time.time_ns(), self._seq + 1)
        return self._seq

    def reservation(self, key: str, provider: str, usd: float | None) -> str:
        """Journal a call before it is sent, with its worst-case USD (None: no known price);
        returns its id for `settled`."""
        rid = f"{key}:{time.time_ns()}:{os.getpid()}"
        _write(self._reservations, {"id": rid, "key": key, "provider": provider, "usd": usd, "_seq": self._next_seq()})
        return rid

    def settled(self, rid: str, usd: float) -> None:
        _write(self._reservations, {"id": rid, "settled": usd, "_seq": self._next_seq()})

    def close(self) -> None:
        """Write what is queued and close. A write that fails here (the disk is full)
        is dropped: the run already stops on that storage error, and a rerun redoes
        those steps (their answers, if paid, are in the run cache)."""
        try:
            self.flush()
        except OSError:
            pass
        finally:
            self._close_files()

    def _close_files(self) -> None:
        self._steps.close()
        self._plans.close()
        self._reservations.close()


def unpriced_calls(folder: Path) -> int:
    """Calls billed with no known price (their cost is unknown, not $0), e.g. an LLM planner's:
    answered, or failed with the usage of an answer that could not be kept."""
    return sum(1 for row in _read(folder / STEPS_FILE)
               if row.get("attempts") and row.get("cost_usd") is None and not row.get("cache_hit")
               and (row["status"] == "ok" or row.get("prompt_tokens") is not None))


def step_failures(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Plan id -> its failed step rows since its last answered one, over every run that wrote this
    journal (an LLM planner's calls, which have no plan lines of their own)."""
    failed: dict[str, list[dict[str, Any]]] = {}
    for row in _read(folder / STEPS_FILE):
        if row["status"] == "ok":
            failed.pop(row["plan_id"], None)
        elif row["status"] != "skipped":
            failed.setdefault(row["plan_id"], []).append(row)
    return failed


def not_sent(row: dict[str, Any]) -> bool:
    """A plan that failed because the shared governor could not be used before its call left
    (down, or refusing its URL's password): nothing was sent, so it uses up none of its reruns
    (RETRY_TRANSIENT) and is never final: the rerun once the server is back resumes it."""
    return row["status"] == "error" and failed_on_governor(row.get("error"))


def counts_as_retry(row: dict[str, Any]) -> bool:
    """A plan's transient failure, one of the RETRY_TRANSIENT a rerun retries."""
    return row["status"] == "error" and row.get("failure") in TRANSIENT_KINDS and not not_sent(row)


def retries_used_up(folder: Path) -> set[str]:
    """Plans whose transient failures a rerun no longer retries: counted as load_state counts them."""
    transient: Counter[str] = Counter()
    for row in _read(folder / PLANS_FILE) if (folder / PLANS_FILE).exists() else ():
        if counts_as_retry(row):
            transient[row["plan_id"]] += 1
    return {pid for pid, n in transient.items() if n > RETRY_TRANSIENT}


def count_unanswered(lost: dict[str, Any], usd: float | None) -> None:
    """Tally one call sent whose answer never came back (maybe billed) in a lost-in-flight count:
    `usd` is its worst case, None when its price is unknown (then it cannot be bounded)."""
    lost["calls"] = lost.get("calls", 0) + 1
    if usd is None:
        lost["unpriced_calls"] = lost.get("unpriced_calls", 0) + 1
    else:
        lost["reserved_usd"] = lost.get("reserved_usd", 0.0) + usd


def load_state(folder: Path, retry_failed: bool = False) -> ResumeState:
    state = ResumeState()
    transient: dict[str, int] = {}  # plan id -> transient failures logged
    # plan id -> its latest line for _Gaps: a tuple (_Gaps.plan_line) if that line ends the plan, else its _seq
    # alone (the lower end of the next line's window). No list per plan: a big journal's resume stays light.
    last: dict[str, tuple | int] = {}
    for row in _read(folder / PLANS_FILE):
        status, pid = row["status"], row["plan_id"]
        if counts_as_retry(row):
            transient[pid] = transient.get(pid, 0) + 1
            final = transient[pid] > RETRY_TRANSIENT
        elif not_sent(row):
            final = False
        else:
            final = status in FINAL_PLAN_STATUSES
        if final and not (retry_failed and status == "error"):
            state.finished.add(pid)
            done = status != "invalid_plan"
        else:
            state.finished.discard(pid)
            done = False
        if status == "invalid_plan":
            state.invalid.add(pid)
        else:
            state.invalid.discard(pid)
        last[pid] = _Gaps.plan_line(row, last.get(pid)) if done else row.get("_seq") or 0
    # invalid plans are finished, not checked: with no other finished plan, no gap work at all
    gaps = _Gaps(last) if len(state.finished) > len(state.invalid) else None
    check = gaps.step if gaps is not None else None
    for row in _read(folder / STEPS_FILE):
        state.steps_logged += 1
        if row.get("cost_usd") and not row.get("cache_hit"):
            state.spent[row["provider"]] = state.spent.get(row["provider"], 0.0) + row["cost_usd"]
        if row.get("attempts") and (key := row.get("request_key")):
            state.paid.add(key)
        if row["plan_id"] in state.finished:
            if check is not None:
                check(row)
        elif row["status"] == "ok":
            _restore(state, row)
    state.gaps = gaps.missing(folder.parent / "plans.parquet") if gaps is not None else {}
    del last, gaps, check
    if state.gaps:  # run again: steps with a line are restored, the others answered by the run cache
        state.finished -= state.gaps.keys()
        for row in _read(folder / STEPS_FILE):
            kept_out = state.gaps.get(row["plan_id"])
            if kept_out is not None and row["status"] == "ok" and row["step_path"] not in kept_out:
                _restore(state, row)
    _read_reservations(folder, state)
    return state


def _restore(state: ResumeState, row: dict[str, Any]) -> None:
    """An answered step of a plan that runs again: its output is used, not asked for again."""
    state.outputs.setdefault(row["plan_id"], {})[row["step_path"]] = row["response_text"]
    if row.get("sub_plan"):
        state.sub_plans.setdefault(row["plan_id"], {})[row["step_path"]] = row["sub_plan"]


_TOP_STEP = {str(i): 1 << i for i in range(64)}  # a top-level step's path -> its bit in _Gaps.plan_line


class _Gaps:
    """Finished plans with step lines missing (a damaged line deleted by hand, as `_read` advises):
    they run again, so that those steps come back from the run's response cache, paid once, instead
    of leaving the outputs and the totals. A plan's latest line counts the calls and cache hits of
    the command that finished it, each with its own step line written before; and every step of a
    finished plan has a line (answered or skipped, if the plan is ok), restored ones an earlier one."""

    def __init__(self, last: dict[str, tuple | int]):
        self.plans = last  # plan id -> its latest line: a plan_line tuple for the plans checked (see load_state)
        self.nested: set[tuple[str, str]] = set()  # (plan id, step path with a dot) of lines that end steps
        self.subs: dict[tuple[str, str], int] = {}  # (plan id, re-planning step's path) -> its sub-plan's steps

    @staticmethod
    def plan_line(row: dict[str, Any], before: tuple | int | None) -> tuple:
        """(_seq of the plan's line before this one, this line's _seq, its calls + cache hits (counted down
        as their step lines are found), whether it is ok, a bit per top-level step with a line ending it)."""
        if type(before) is tuple:
            before = before[1]
        return (before or 0, row.get("_seq") or 0,
                (row.get("calls") or 0) + (row.get("cache_hits") or 0), row["status"] == "ok", 0)

    def step(self, row: dict[str, Any]) -> None:
        pid = row["plan_id"]
        line = self.plans.get(pid)
        if type(line) is not tuple:
            return
        low, high, left, ok, have = line
        if row.get("attempts") or row.get("cache_hit"):
            seq = row.get("_seq")
            if not high or seq is None or low < seq <= high:
                left -= 1
        path = row["step_path"]
        if not ok or row["status"] in ("ok", "skipped"):
            if (bit := _TOP_STEP.get(path)) is not None:
                have |= bit
            elif (done := path.removesuffix(".repair")).isdigit():
                have |= 1 << int(done)
            else:
                self.nested.add((pid, done))
        self.plans[pid] = (low, high, left, ok, have)
        if row.get("sub_plan") and not path.endswith(".plan"):
            self.subs[(pid, path)] = len(orjson.loads(row["sub_plan"]).get("steps") or ())

    def missing(self, plans_file: Path) -> dict[str, frozenset[str]]:
        """Plan id -> the step paths not to restore when it runs again: those missing, and the
        re-planning steps above them (restored, a re-planning step would not run its sub-plan)."""
        lost: dict[str, list[str]] = {}
        for pid, n in _step_counts(plans_file, self.plans):
            if (have := self.plans[pid][4]) != (1 << n) - 1:
                lost[pid] = [str(i) for i in range(n) if not have >> i & 1]
        for (pid, path), n in self.subs.items():  # a re-planning step: its planning, its sub-plan's steps
            lost[pid] = lost.get(pid, []) + [p for p in (f"{path}.plan", *(f"{path}.{i}" for i in range(n)))
                                             if (pid, p) not in self.nested]
        gaps = {pid: frozenset(".".join(p.split(".")[:i]) for p in paths for i in range(1, p.count(".") + 2))
                for pid, paths in lost.items() if paths}
        gaps.update((pid, frozenset()) for pid, line in self.plans.items()
                    if type(line) is tuple and line[2] > 0 and pid not in gaps)
        return gaps


def _step_counts(plans_file: Path, plans: dict[str, tuple | int]):
    """(plan id, top-level steps) of the plans checked (a tuple in `plans`), from the run's plans.parquet
    (none without it: an LLM planner's journal, or a journal read on its own). Read in small pieces, with
    no thread or read-ahead: a resume of a big run holds less memory."""
    if not plans_file.exists():
        return
    import pyarrow.parquet as pq

    with pq.ParquetFile(plans_file, pre_buffer=False, buffer_size=1 << 16) as f:
        if "n_steps" not in f.schema_arrow.names:
            return
        for batch in f.iter_batches(columns=["plan_id", "n_steps"], batch_size=8192, use_threads=False):
            for pid, n in zip(*(c.to_pylist() for c in batch.columns)):
                if n and type(plans.get(pid)) is tuple:
                    yield pid, n


def _read_reservations(folder: Path, state: ResumeState) -> None:
    path = folder / RESERVATIONS_FILE
    for row in _read(path):
        if "settled" not in row:
            state.unsettled[row["id"]] = (row["key"], row["provider"], row["usd"])
            continue
        key, provider, _ = state.unsettled.pop(row["id"], (None, None, None))
        if key is not None and row["settled"] and key not in state.paid:
            # Answered and settled, but killed before its step row was written: paid all the same.
            state.unsettled[row["id"]] = (key, provider, row["settled"])
    # A paid step row is its call's settlement too: a call whose settled line is gone (deleted by hand,
    # or its write failed) is no call lost in flight. That call is the latest of its key's reservations
    # before the row: earlier ones stay unsettled (tries cut off by timeout_s, or calls a killed process
    # sent), and so do later ones (sent after it). A failed try's $0 settlement says nothing about them.
    keys = {key for key, _, _ in state.unsettled.values() if key in state.paid}
    if not keys:
        return
    sent: dict[str, list[tuple[int, str]]] = {key: [] for key in keys}  # key -> (_seq, id) of its reservations
    for row in _read(path):
        if "settled" not in row and (calls := sent.get(row["key"])) is not None:
            calls.append((_reserved_at(row), row["id"]))
    for key, rows in _paid_rows(folder / STEPS_FILE, keys).items():
        calls = sent[key]
        for seq in sorted(rows):
            answered = max((c for c in calls if c[0] < seq), default=None)
            if answered is not None:  # each row its own call: two rows of a key are two calls
                calls.remove(answered)
                state.unsettled.pop(answered[1], None)


def _reserved_at(row: dict[str, Any]) -> int:
    """A reservation's place among the journal's lines: its `_seq`, or for a line written before
    reservations had one, the clock its id holds ("<request key>:<ns>:<pid>"), as step lines' `_seq` did."""
    try:
        return row.get("_seq") or int(row["id"].rsplit(":", 2)[1])
    except (IndexError, ValueError):  # an id edited by hand: taken as the key's first call
        return 0


_REQUEST_KEY = b'"request_key":"'  # as orjson writes it: a step line's own field (quotes in text are escaped)


def _paid_rows(path: Path, keys: set[str]) -> dict[str, list[float]]:
    """Request key -> the `_seq` of each paid step row of it (no `_seq`: after every reservation), for
    a few keys. Only the lines holding one of them are parsed, found by a byte search: a second full
    read of a big journal would add most of load_state's time again to every resume of a run that
    ever had a call cut off or killed in flight."""
    wanted = {key.encode() for key in keys}
    rows: dict[str, list[float]] = {}
    size = 1 << 23
    with open(path, "rb") as f:
        while data := f.read(size):
            end = data.rfind(b"\n") + 1  # whole lines: the rest is read again (a torn last line never ends)
            if end == 0 and len(data) == size:  # a line longer than a read
                f.seek(-len(data), os.SEEK_CUR)
                size *= 2
                continue
            f.seek(end - len(data), os.SEEK_CUR)
            at = data.find(_REQUEST_KEY, 0, end)
            while at >= 0:
                at += len(_REQUEST_KEY)
                if data[at:data.find(b'"', at, end)] in wanted:
                    row = orjson.loads(data[data.rfind(b"\n", 0, at) + 1:data.find(b"\n", at)])
                    if row.get("attempts") and row.get("request_key") in keys:
                        rows.setdefault(row["request_key"], []).append(row.get("_seq") or float("inf"))
                at = data.find(_REQUEST_KEY, at, end)
            if end == 0:  # a torn last line only
                break
    return rows


def _write(f: IO[bytes], row: dict[str, Any]) -> None:
    """Append one line, unbuffered; a write that fails part way (disk full) is cut
    back off, so that the file holds whole lines only and the write can be retried."""
    _write_bytes(f, orjson.dumps(row) + b"\n")


def _last_seq(*paths: Path) -> int:
    """The largest `_seq` the files' last lines hold (0 for none): where a new command's lines
    start, whatever its clock says."""
    last = 0
    for path in paths:
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - (1 << 20)))
                tail = f.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
            last = max(last, int(orjson.loads(tail).get("_seq") or 0))
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # none yet, or a line past the tail read: the clock alone, as before
    return last


def _write_bytes(f: IO[bytes], lines: bytes) -> None:
    data = memoryview(lines)
    start = os.fstat(f.fileno()).st_size
    try:
        while data:
            data = data[f.write(data) or 0:]
    except OSError:
        try:
            os.ftruncate(f.fileno(), start)
        except OSError:
            pass
        raise


def _open_append(path: Path) -> IO[bytes]:
    if path.exists() and path.stat().st_size:
        _cut_torn_tail(path)
    return open(path, "ab", buffering=0)


def _cut_torn_tail(path: Path) -> None:
    with open(path, "rb+") as f:
        end = f.seek(0, 2)
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos = end
        while pos > 0:
            size = min(1 << 16, pos)
            pos -= size
            f.seek(pos)
            nl = f.read(size).rfind(b"\n")
            if nl >= 0:
                f.truncate(pos + nl + 1)
                return
        f.truncate(0)


def _read(path: Path):
    if not path.exists():
        return
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break  # torn by a kill
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                row = e
            if not isinstance(row, dict):
                raise ConductorError(
                    f"{path}, line {n}: not a journal line ({str(row)[:100] if isinstance(row, Exception) else row!r}). "
                    f"The file was edited or damaged; delete that line (sed -i '{n}d' '{path}') and rerun: "
                    f"{_after_delete(path)}") from None
            yield row


def _after_delete(path: Path) -> str:
    """What the rerun does without a line of this journal file (the advice of `_read`'s refusal)."""
    if path.name == STEPS_FILE and path.parent.name == "planner":  # runner.planning_dir: an LLM planner's calls
        return ("the planning call it recorded is asked again, from the planner's response cache (not paid "
                "again), if planning had not finished; if it had, nothing runs again, and that call's cost "
                "moves from the planning cost to the lost-in-flight line (budgets count it all the same)")
    return _AFTER_DELETE.get(path.name, "what it recorded is done again")


_AFTER_DELETE = {  # batches.jsonl: batchfiles.BATCHES_FILE (that module imports this one)
    STEPS_FILE: "the step it recorded runs again, taken from the response caches if it had been answered (not "
                "paid again), and its plan with it if that had finished (a step of it that had failed is sent "
                "again); only a failed try that a later line of the same step replaced is not run again, and "
                "what that try was billed, if anything, leaves the totals",
    PLANS_FILE: "the plan it recorded runs again unless another line records it (then the latest of those "
                "stands): its answered steps are taken from steps.jsonl, not paid again, and a failed one is "
                "sent again",
    RESERVATIONS_FILE: "nothing runs again. If the line recorded a call sent and never answered (cut off by "
                       "timeout_s, or in flight when a process was killed), that call leaves the lost-in-flight "
                       "count and the budget's spend; if it recorded the end of a call that failed without an "
                       "answer, that call is counted as lost in flight, at its worst-case price",
    "batches.jsonl": "a batch it recorded is looked up at the provider by its input file and polled, not "
                     "submitted again; only if the line was the one record of an upload whose batch a killed "
                     "process created may that batch's lines be submitted, and paid, again",
}
