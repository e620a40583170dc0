"""A shared governor down for a few seconds fails nothing. A call it keeps back sent nothing,
so it waits for the server by time (from when the outage began), not by max_attempts: with
full-jitter waits over max_attempts, a 3 s Redis outage failed 16 of 200 plans (audit67 F3),
and with max_attempts 1 any outage failed every call it met.

Real parts only: `conductor run` as a user starts it, the simulated LLM server over HTTP and a
real redis-server on a free 127.0.0.1 port, killed mid-run and started again on the same port."""

from __future__ import annotations

import shutil
import threading
import time
from functools import partial

import pyarrow.parquet as pq
import pytest

from tests.conftest import SAMPLE, worker, write_pool
from tests.test_budget_governor_stop39 import (assert_finished_as_if_never_down, failed_on_the_governor, setup,
                                               start_redis, start_run, tables, wait_until)

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


@pytest.mark.parametrize("down_s, provider", [
    (3.5, {}),  # the defaults (max_attempts 6), under a budget: reservations and rate slots wait
    (3.0, {"max_attempts": 1, "budget_usd": None}),  # no retry of a sent request: a call never sent still waits
], ids=["defaults-budget", "max_attempts-1"])
def test_an_outage_of_a_few_seconds_fails_no_plan(tmp_path, fresh_sim, down_s, provider):
    server = start_redis()
    try:
        queries, pool = setup(tmp_path, 40, server.url, fresh_sim.url, ("slow",), **provider)
        p = start_run(tmp_path, queries, pool)
        wait_until(p, lambda: fresh_sim.log()["total"] >= 8, "8 calls were answered")
        server.kill()
        time.sleep(down_s)
        server.start()  # the same port: back, empty
        stdout, stderr = p.communicate(timeout=300)
    finally:
        server.stop()
    assert_finished_as_if_never_down(p, stdout, stderr, tmp_path, fresh_sim, 40)


def test_a_governor_that_stays_down_fails_the_calls_it_kept_back_once_the_wait_is_over(
        tmp_path, fresh_sim, monkeypatch):
    """Down for good: the calls it kept back fail once the outage has lasted governor_wait_s
    (30 s by default; 2 s here), naming the server and the wait, with attempts 0; the answers
    already paid for are kept, and the rerun once it is back sends only what was never sent."""
    import conductor.runner
    from conductor.execute.engine import ExecOptions
    from conductor.runner import RunConfig, run_all
    from tests.test_executor import FixedPlanner, solve

    monkeypatch.setattr(conductor.runner, "ExecOptions", partial(ExecOptions, governor_wait_s=2.0))
    monkeypatch.delenv("CONDUCTOR_GOVERNOR", raising=False)
    queries = tmp_path / "q.parquet"
    pq.write_table(pq.read_table(SAMPLE).slice(0, 40), queries)
    server = start_redis()
    try:
        pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("slow",), providers={"sim": {
            "max_concurrency": 4, "timeout_s": 10, "max_attempts": 1}})
        pool.write_text(pool.read_text() + f"governor: {server.url}\n")
        cfg = RunConfig(queries=queries, pool=pool, data_dir=tmp_path / "data", progress=False, run_id="gov",
                        cache=False)
        def kill_once_under_way():  # not on a clock: on a busy machine a timer fired before the run's
            deadline = time.monotonic() + 120  # check of the governor, and the run was refused instead
            while fresh_sim.log()["total"] < 8 and time.monotonic() < deadline:
                time.sleep(0.02)
            server.kill()

        killer = threading.Thread(target=kill_once_under_way, daemon=True)  # 40 calls of 0.3 s, 4 at a time
        killer.start()
        run_all(cfg, planner=FixedPlanner(solve("slow")))
        killer.join()
        traces, _ = tables(tmp_path)
        failed_on_the_governor(traces, server.port)
        assert sum(t["attempts"] for t in traces) == fresh_sim.log()["total"]

        server.start()
        run_all(cfg, planner=FixedPlanner(solve("slow")))
    finally:
        server.stop()
    traces, results = tables(tmp_path)
    assert [r["status"] for r in results] == ["ok"] * 40
    log = fresh_sim.log()
    assert max(log["by_request_key"].values()) == 1 and log["total"] == 40  # no answer paid for twice
