"""A call's settled line deleted by hand (as the refusal of a damaged line advises) is no call lost in
flight: the step's paid row settles it. For a step that needed a retry this did not hold (review40b 3):
the $0 settlements of its failed tries were taken for its answer's, so the answered call stayed "lost in
flight" on every later command, maybe billed at its worst case, and counted against the budgets."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import orjson
import pytest

from tests.conftest import first_queries, run_cli, worker, write_pool

BUDGET = "5"


@pytest.fixture(scope="module")
def retried(tmp_path_factory, sample_queries, sim):
    """A finished run on a server that answers 40% of requests with a 5xx: steps retried, then answered.
    24 steps, so that none retried is a chance of 0.6**24 (with 12, one fresh clone's run drew it), and
    20 attempts, so that a step failing for good is one of 0.4**20."""
    sim.clear_faults()
    sim.set_faults("flaky", error_rate=0.4)
    try:
        d = tmp_path_factory.mktemp("retried")
        pool = write_pool(d / "pool.yaml", sim.url, providers={"sim": {"max_concurrency": 8, "max_attempts": 20}},
                          workers=[worker("flaky", sim.url)])
        args = ["run", first_queries(tmp_path_factory, sample_queries, 24), "--pool", pool, "--no-cache",
                "--budget", BUDGET, "--quiet"]
        r = run_cli(*args, "--data-dir", d / "data")
        assert r.returncode == 0, r.stderr
    finally:
        sim.clear_faults()
    return args, d / "data"


def _lines(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


def _write(path: Path, rows: list[dict]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def _totals(run: Path) -> dict:
    """What the summary says was paid, spent under the budget and lost in flight."""
    s = json.loads((run / "summary.json").read_text())
    return {"statuses": s["statuses"], "calls": s["calls"], "cost_usd": round(s["cost_usd"], 9),
            "lost_in_flight": s["lost_in_flight"], "spent": [(c["cap"], round(c["spent_usd"], 9)) for c in s["spend"]]}


def _copy_with_a_retried_step(retried, tmp_path) -> tuple[list, Path, Path, str, list[dict]]:
    """A copy of the run, and a step answered after failed tries: its request key and reservation lines."""
    args, data = retried
    shutil.copytree(data, tmp_path / "data")
    run = next((tmp_path / "data" / "runs").iterdir())
    steps = _lines(run / "work" / "steps.jsonl")
    keys = [s["request_key"] for s in steps if s["status"] == "ok" and s["attempts"] > 1]
    assert keys, "no step needed a retry: raise the error rate"
    key = keys[0]
    tries = [r for r in _lines(run / "work" / "reservations.jsonl") if r.get("key") == key]
    assert len(tries) > 1
    return args, tmp_path / "data", run, key, tries


def _rerun(args, data, sim) -> str:
    sim.reset()
    r = run_cli(*args, "--data-dir", data)
    assert r.returncode == 0, r.stderr
    assert sim.log()["total"] == 0  # every plan had finished: nothing sent
    return r.stdout


def test_the_deleted_settled_line_of_a_call_answered_after_a_retry_is_no_call_lost_in_flight(
        retried, tmp_path, fresh_sim):
    args, data, run, key, tries = _copy_with_a_retried_step(retried, tmp_path)
    intact = _totals(run)
    assert not intact["lost_in_flight"].get("calls")
    path = run / "work" / "reservations.jsonl"
    answered = tries[-1]["id"]  # the last try is the answered one; the others were settled at $0
    _write(path, [r for r in _lines(path) if not (r.get("settled") is not None and r["id"] == answered)])
    out = _rerun(args, data, fresh_sim)
    assert _totals(run) == intact  # not lost in flight, and not counted again against the budget
    assert "lost in flight" not in out


def test_a_try_cut_off_before_them_is_still_lost_in_flight(retried, tmp_path, fresh_sim):
    """Of the step's unsettled tries, only its answered one is settled by its row: a try cut off by
    timeout_s before the failed ones (never settled: the provider may have answered and billed it)
    stays lost in flight, once, at its worst case."""
    args, data, run, key, tries = _copy_with_a_retried_step(retried, tmp_path)
    intact = _totals(run)
    path = run / "work" / "reservations.jsonl"
    rows = _lines(path)
    first = rows.index(tries[0])
    cut = {**tries[0], "id": f"{key}:{int(tries[0]['id'].split(':')[-2]) - 1}:1", "_seq": tries[0]["_seq"] - 1}
    answered = tries[-1]["id"]
    rows = rows[:first] + [cut] + rows[first:]
    _write(path, [r for r in rows if not (r.get("settled") is not None and r["id"] == answered)])
    out = _rerun(args, data, fresh_sim)
    got = _totals(run)
    assert got["lost_in_flight"]["calls"] == 1
    assert got["lost_in_flight"]["reserved_usd"] == pytest.approx(cut["usd"])
    assert got["spent"] == [(cap, pytest.approx(usd + cut["usd"])) for cap, usd in intact["spent"]]
    assert "lost in flight" in out


def test_a_new_command_numbers_its_lines_after_the_last_reservation_too(tmp_path):
    """A paid row's call is its key's latest reservation before the row: a command whose lines were
    numbered below a killed one's last reservations (a clock stepped back) would take that killed
    call for its own answered one, and drop it from what was lost in flight."""
    from conductor.execute.journal import PLANS_FILE, RESERVATIONS_FILE, STEPS_FILE, Journal

    work = tmp_path / "work"
    work.mkdir()
    ahead = time.time_ns() + 3600 * 10**9
    (work / STEPS_FILE).write_bytes(orjson.dumps({"plan_id": "p", "step_path": "0", "_seq": ahead - 10}) + b"\n")
    (work / PLANS_FILE).write_bytes(b"")
    (work / RESERVATIONS_FILE).write_bytes(orjson.dumps(
        {"id": f"K:{ahead}:1", "key": "K", "provider": "p", "usd": 0.1, "_seq": ahead}) + b"\n")
    journal = Journal(work)
    journal.step({"plan_id": "q", "step_path": "0"})
    journal.close()
    assert _lines(work / STEPS_FILE)[-1]["_seq"] > ahead
