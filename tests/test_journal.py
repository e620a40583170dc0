"""The run journal survives a kill mid-line and restores what a resume needs."""

import os

import orjson
import pytest

from conductor.execute.journal import Journal, load_state


def _step(plan, path, status="ok", cost=0.01, provider="p", cache_hit=False):
    return {"plan_id": plan, "step_path": path, "status": status, "cost_usd": cost, "provider": provider,
            "cache_hit": cache_hit, "response_text": f"out {plan} {path}"}


def test_state_restores_unfinished_plans_and_spend(tmp_path):
    j = Journal(tmp_path)
    j.step(_step("a", "0"))
    j.step(_step("a", "1"))
    j.plan({"plan_id": "a", "status": "ok"})
    j.step(_step("b", "0"))
    j.step(_step("b", "1", status="budget_exhausted", cost=None))
    j.plan({"plan_id": "b", "status": "budget_exhausted"})
    j.step(_step("c", "0", cost=0.5, cache_hit=True))
    j.close()
    s = load_state(tmp_path)
    assert s.finished == {"a"}  # b was stopped by the budget: it runs again
    assert s.outputs == {"b": {"0": "out b 0"}, "c": {"0": "out c 0"}}
    assert abs(s.spent["p"] - 0.03) < 1e-12  # cache hits cost nothing


def test_torn_last_line_is_cut_and_appending_continues(tmp_path):
    j = Journal(tmp_path)
    j.step(_step("a", "0"))
    j.close()
    with open(tmp_path / "steps.jsonl", "ab") as f:
        f.write(b'{"plan_id": "a", "step_pa')  # the process died here
    assert load_state(tmp_path).steps_logged == 1
    j = Journal(tmp_path)
    j.step(_step("a", "1"))
    j.close()
    lines = (tmp_path / "steps.jsonl").read_bytes().splitlines()
    assert [orjson.loads(x)["step_path"] for x in lines] == ["0", "1"]


def test_a_paid_step_line_never_reaches_the_disk_before_its_answer(tmp_path, monkeypatch):
    """A kill between the two writes of one loop turn must not leave a step line saying a
    call was paid whose answer the run cache lacks: a resume would send that call again
    (and pay twice) for any other plan asking the same thing. So in the run's execution
    context, whatever was queued first, the run cache commits before the journal writes."""
    import asyncio

    from conductor.execute.cache import Cache, Entry
    from conductor.execute.context import ExecutionContext
    from conductor.execute.engine import ExecOptions
    from conductor.execute.journal import ResumeState
    from conductor.pool import parse_pool

    seen_at_commit: list[bytes] = []
    commit = Cache.flush

    def spy(self):
        if self._pending and (tmp_path / "work" / "steps.jsonl").exists():
            seen_at_commit.append((tmp_path / "work" / "steps.jsonl").read_bytes())
        commit(self)

    monkeypatch.setattr(Cache, "flush", spy)
    pool = parse_pool({"workers": [{"id": "w", "model": "openai/m", "api_base": "http://127.0.0.1:9/v1"}]})
    entry = Entry("42", 10, 2, False, False, 0.001, 0.1)

    async def one_turn(ex):
        ex.journal.plan({"plan_id": "earlier", "status": "ok"})  # queued first: its flush is scheduled first
        ex.run_cache.put("k", "m", entry)
        ex.journal.step({**_step("a", "0"), "attempts": 1, "request_key": "k"})
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    with ExecutionContext(tmp_path / "work", pool, ExecOptions(run_id="r"), state=ResumeState()) as ex:
        asyncio.run(one_turn(ex))
        assert (tmp_path / "work" / "steps.jsonl").read_bytes()  # the turn was written
    assert seen_at_commit and all(b'"request_key":"k"' not in lines for lines in seen_at_commit)


def test_ctrl_c_as_the_run_winds_down_is_an_interrupt_not_a_silent_finish(tmp_path):
    """A Ctrl-C that came after the last plan ended was swallowed: the run went on to grade and
    exited 0 (seen beside a busy core, a SIGINT at the end of the execute stage). Run in its own
    process: signal handlers belong to a main thread, which a test worker's may not be."""
    import signal
    import subprocess
    import sys

    script = f"""
import asyncio, os, signal
from pathlib import Path
from conductor.execute.context import ExecutionContext
from conductor.execute.engine import ExecOptions
from conductor.execute.journal import ResumeState
from conductor.pool import parse_pool

pool = parse_pool({{"workers": [{{"id": "w", "model": "openai/m", "api_base": "http://127.0.0.1:9/v1"}}]}})

def jobs():
    os.kill(os.getpid(), signal.SIGINT)  # as the last job is taken
    return
    yield

with ExecutionContext(Path({str(tmp_path / "work")!r}), pool, ExecOptions(run_id="r"), state=ResumeState()) as ex:
    try:
        asyncio.run(ex.run(jobs()))
        print("finished")
    except KeyboardInterrupt:
        print("interrupted", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    assert r.stdout.strip() == "interrupted True", r.stdout + r.stderr  # and Ctrl-C is Python's again


def test_a_full_disk_met_by_the_run_cache_in_a_scheduled_flush_is_raised_where_the_run_sees_it(tmp_path):
    """The journal's scheduled flush commits the run cache first; a full disk there escaped to
    asyncio, which printed `Exception in callback AfterTurn._run()` and a traceback before the
    run's own clean message (audit47 F6)."""
    import asyncio
    import sqlite3

    from conductor.execute.journal import Journal

    def full():
        raise sqlite3.OperationalError("database or disk is full")

    j = Journal(tmp_path, answers_first=full)
    unhandled = []

    async def turn():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unhandled.append(ctx))
        j.step({**_step("a", "0"), "attempts": 1})
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        with pytest.raises(sqlite3.OperationalError, match="disk is full"):
            j.step({**_step("a", "1"), "attempts": 1})

    asyncio.run(turn())
    assert unhandled == []
