"""A step's budget reservation is taken once it has a place among its provider's calls in flight
in this process, not while it is still queued (audit79 F2): a process holds at most
max_concurrency worst cases per provider, with the in-process governor and with the shared one,
where a kill -9 left one per queued step (54 on a provider of 16), all charged in full when their
leases ended. A step that waits for budget room keeps its place; that must neither deadlock nor
let the total pass the budget.

Against the simulated pool over HTTP (its `slow` worker answers in 300 ms) and a real
redis-server on 127.0.0.1, on a free port."""

from __future__ import annotations

import itertools
import json
import shutil
import time

import pyarrow.parquet as pq
import pytest
import yaml

from conductor.execute.budget import Ledger
from conductor.planners.base import PlanDraft
from conductor.runner import RunConfig, run_all
from tests.conftest import first_queries, kill_when_journaled, worker, write_pool


class OneStep:
    """One step per plan, on the worker `pick()` names: the executor alone is under test."""

    name = "fixed"

    def __init__(self, pick):
        self.pick = pick

    def plan(self, queries, pool, samples):
        return [[PlanDraft(text=json.dumps({"steps": [
            {"worker": self.pick(), "instruction": f"{q.prompt}\nEnd with 'Answer: ...'", "access": []}]}))]
            * samples for q in queries]


@pytest.fixture
def peaks(monkeypatch):
    """The most reservations held at once, per cap name, seen at each reserve."""
    seen: dict[str, int] = {}
    reserve = Ledger.reserve

    async def counted(self, provider, amount):
        r = await reserve(self, provider, amount)
        for cap in (*self.providers.values(), self.run):
            seen[cap.name] = max(seen.get(cap.name, 0), cap.holds)
        return r

    monkeypatch.setattr(Ledger, "reserve", counted)
    return seen


def _run(tmp_path, pool, queries, planner, **kw):
    summary = run_all(RunConfig(queries=queries, pool=pool, data_dir=tmp_path / "data", progress=False,
                                cache=False, **kw), planner=planner)
    out = tmp_path / "data" / "runs" / summary["run_id"]
    return summary, pq.read_table(out / "traces.parquet").to_pylist()


def test_queued_steps_hold_no_reservation_in_process(tmp_path, fresh_sim, tmp_path_factory, sample_queries, peaks):
    """40 steps, 4 at a time, 300 ms each: at most 4 reservations at once (before: one per plan
    in flight, 32 here)."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("slow",),
                      providers={"sim": {"max_concurrency": 4, "timeout_s": 10, "budget_usd": 5.0}})
    summary, traces = _run(tmp_path, pool, first_queries(tmp_path_factory, sample_queries, 40),
                           OneStep(lambda: "slow"))
    assert [t["status"] for t in traces] == ["ok"] * 40
    assert 1 <= peaks["provider sim"] <= 4, peaks


def test_a_step_waiting_to_retry_holds_no_reservation(tmp_path, fresh_sim, tmp_path_factory, sample_queries, peaks):
    """Half the attempts fail with a 500 and wait to retry: a failed attempt was not billed, so its
    reservation is given back before the wait, and the waits do not add to the 4."""
    fresh_sim.set_faults("slow", error_rate=0.5, fail_status=500)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("slow",),
                      providers={"sim": {"max_concurrency": 4, "timeout_s": 10, "budget_usd": 5.0,
                                         "max_attempts": 8}})
    summary, traces = _run(tmp_path, pool, first_queries(tmp_path_factory, sample_queries, 24),
                           OneStep(lambda: "slow"))
    assert sum(t["attempts"] for t in traces) > 24  # some did retry
    assert 1 <= peaks["provider sim"] <= 4, peaks


def test_waiting_for_budget_room_with_a_place_ends_and_never_overspends(tmp_path, fresh_sim, tmp_path_factory,
                                                                        sample_queries, peaks):
    """Two providers under one run budget that runs out mid-run (120 steps; room for about 8 worst
    cases at once, and for about 65 answers in all): provider a has one place, b two.
    Steps that wait for room keep their place; the run still ends (every step answered or refused
    by the budget), within the budget, with at most 1 + 2 worst cases held at once."""
    url = fresh_sim.url
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({
        "providers": {"a": {"max_concurrency": 1, "timeout_s": 10}, "b": {"max_concurrency": 2, "timeout_s": 10}},
        "workers": [worker("slow", url, provider="a"), worker("fast", url, provider="b")]}, sort_keys=False))
    turn = itertools.cycle(["slow", "fast", "fast", "fast"])
    budget = 0.005
    t0 = time.monotonic()
    summary, traces = _run(tmp_path, pool, sample_queries, OneStep(lambda: next(turn)),
                           budget_usd=budget, samples=2)
    assert time.monotonic() - t0 < 120
    statuses = {t["status"] for t in traces}
    assert statuses <= {"ok", "budget_exhausted"} and "budget_exhausted" in statuses, statuses
    assert {t["worker"] for t in traces if t["status"] == "ok"} == {"slow", "fast"}
    assert sum(t["cost_usd"] or 0.0 for t in traces) <= budget + 1e-12
    assert peaks["run"] <= 3, peaks


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_a_killed_process_leaves_at_most_max_concurrency_shared_reservations(tmp_path, fresh_sim,
                                                                              tmp_path_factory, sample_queries,
                                                                              monkeypatch):
    """The audit's reproduction, small: kill -9 mid-run under a shared budget; the server holds at
    most max_concurrency of the process's reservations (its calls that had a place), not one per
    plan it had started (32 here before), which would all be charged in full when their leases end."""
    from tests.test_shared_governor import start_redis

    monkeypatch.delenv("CONDUCTOR_BUDGET_SCOPE", raising=False)
    monkeypatch.delenv("CONDUCTOR_GOVERNOR", raising=False)
    with start_redis() as server:
        pool = tmp_path / "pool.yaml"
        pool.write_text(yaml.safe_dump({
            "governor": server.url,
            "providers": {"sim": {"max_concurrency": 4, "timeout_s": 10, "budget_usd": 5.0}},
            "workers": [worker("slow", fresh_sim.url)]}, sort_keys=False))
        queries = first_queries(tmp_path_factory, sample_queries, 40)
        run_dir = kill_when_journaled(["run", queries, "--pool", pool, "--no-cache", "--quiet", "--planner",
                                       "embedded"], tmp_path / "data", 8)
        assert run_dir is not None, "the run ended before it was killed"
        import redis

        client = redis.Redis.from_url(server.url)
        try:
            held = client.hlen("conductor:gov:budget:default:sim:amounts")
            reserved = float(client.hget("conductor:gov:budget:default:sim", "reserved") or 0)
        finally:
            client.close()
        assert 1 <= held <= 4, (held, reserved)
