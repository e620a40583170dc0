"""A request cut off by `timeout_s` has left: the provider may still answer it, and bill
it. It is charged at its worst case to the budgets, as a killed process's call is, and
counted in the summary's `lost in flight` line; checked against the simulated server's
own bill (it bills a request once accepted, whether the client waited or not)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import orjson
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import PRICE_IN, PRICE_OUT, REPO, first_queries, run_cli, worker

HANG_S = 1.5


@pytest.fixture(scope="module")
def queries(tmp_path_factory, sample_queries):
    return first_queries(tmp_path_factory, sample_queries, 40)


def pool_file(path, url, **provider):
    path.write_text(yaml.safe_dump({
        "providers": {"sim": {"max_concurrency": 16, "timeout_s": 0.5, "max_attempts": 4, **provider}},
        "workers": [worker(n, url) for n in ("fast", "weak")]}))
    return path


def billed_usd(log: dict) -> float:
    return sum(p * PRICE_IN + c * PRICE_OUT for p, c in log["billed_tokens"].values())


def cut_off(sim) -> int:
    time.sleep(HANG_S + 0.5)  # the server logs a 499 when it finds the client gone
    return sim.log()["by_status"].get("499", 0)


def test_a_budget_holds_against_requests_cut_off_by_timeout(tmp_path, fresh_sim, queries):
    fresh_sim.set_faults(hang_rate=0.3, hang_s=HANG_S)
    budget = 0.004
    data = tmp_path / "data"
    r = run_cli("run", queries, "--pool", pool_file(tmp_path / "pool.yaml", fresh_sim.url), "--quiet",
                "--no-cache", "--data-dir", data, "--budget", budget, "--max-failed-share", "1")
    assert r.returncode == 3, r.stdout + r.stderr  # the budget stopped it
    hung = cut_off(fresh_sim)
    billed = billed_usd(fresh_sim.log())
    assert hung > 0
    assert billed <= budget  # by the provider's own bill
    summary = orjson.loads((next((data / "runs").iterdir()) / "summary.json").read_bytes())
    lost = summary["lost_in_flight"]
    assert lost["calls"] == hung  # each cut-off request, and nothing else
    assert summary["cost_usd"] + lost["reserved_usd"] >= billed  # what may have been billed is counted
    assert {c["cap"]: c["spent_usd"] for c in summary["spend"]}["run"] <= budget
    assert re.search(rf"lost in flight +{hung} call\(s\) sent whose answers never came back", r.stdout), r.stdout


def test_a_rerun_counts_cut_off_requests_once_and_sends_only_unfinished_plans(tmp_path, fresh_sim, queries):
    fresh_sim.set_faults(hang_rate=0.2, hang_s=HANG_S)
    pool = pool_file(tmp_path / "pool.yaml", fresh_sim.url, max_attempts=2)
    data = tmp_path / "data"
    first = run_cli("run", queries, "--pool", pool, "--quiet", "--no-cache", "--data-dir", data,
                    "--max-failed-share", "1")
    assert first.returncode in (0, 4), first.stdout + first.stderr
    hung = cut_off(fresh_sim)
    summary_path = next((data / "runs").iterdir()) / "summary.json"
    assert orjson.loads(summary_path.read_bytes())["lost_in_flight"]["calls"] == hung > 0
    fresh_sim.clear_faults()
    again = run_cli("run", queries, "--pool", pool, "--quiet", "--no-cache", "--data-dir", data)
    assert again.returncode == 0, again.stdout + again.stderr
    summary = orjson.loads(summary_path.read_bytes())
    assert summary["lost_in_flight"]["calls"] == hung  # read again from the journal: not counted twice
    assert summary["statuses"] == {"ok": 40}


@pytest.mark.slow  # waits on the clock
def test_a_tokens_per_minute_limit_is_not_drained_by_usage_the_budgets_already_refused(tmp_path, fresh_sim,
                                                                                      queries):
    """Usage 1,000 times what a request could use is clamped for cost; the tpm bucket believed
    it and held each next call for minutes (audit38: 6 calls in 100 s). Here, believed, the 20
    calls would take about 5 minutes; clamped, about 2 s: the 60 s bound leaves room for a busy machine."""
    fresh_sim.set_faults(usage_factor=1000)
    pool = pool_file(tmp_path / "pool.yaml", fresh_sim.url, tpm=600_000, timeout_s=10)
    ten = tmp_path / "ten.parquet"
    pq.write_table(pq.read_table(queries).slice(0, 10), ten)
    r = run_cli("run", ten, "--pool", pool, "--quiet", "--no-cache", "--data-dir", tmp_path / "data", timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = orjson.loads((next((tmp_path / "data" / "runs").iterdir()) / "summary.json").read_bytes())
    assert summary["statuses"] == {"ok": 10} and summary["calls"] == 20


def test_calls_waiting_out_a_retry_after_when_killed_are_not_counted_lost(tmp_path, fresh_sim, queries):
    """Their last attempt was answered with a 429, unbilled: the resume must not count them as
    sent and maybe billed (audit38: 32 calls "lost", then a budget stop on money never spent)."""
    fresh_sim.set_faults(rate_limit_rate=1.0, retry_after_ms=30_000)
    pool = pool_file(tmp_path / "pool.yaml", fresh_sim.url, timeout_s=10, max_attempts=8, budget_usd=0.03)
    data = tmp_path / "data"
    cmd = [sys.executable, "-m", "conductor", "run", str(queries), "--pool", str(pool), "--quiet", "--no-cache",
           "--data-dir", str(data)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while fresh_sim.log()["by_status"].get("429", 0) < 16:  # the first calls, all told to wait 30 s
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(1.0)  # their answers are read and journaled; the rest wait for the provider's pause
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    told = fresh_sim.log()["by_status"]
    assert set(told) == {"429"}, told  # nothing was answered, nothing in flight
    fresh_sim.clear_faults()
    r = run_cli("run", queries, "--pool", pool, "--quiet", "--no-cache", "--data-dir", data)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = orjson.loads((next((data / "runs").iterdir()) / "summary.json").read_bytes())
    assert summary["lost_in_flight"]["calls"] == 0 and "lost in flight" not in r.stdout
    assert summary["statuses"] == {"ok": 40}
