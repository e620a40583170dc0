"""The executor against the simulated pool over real HTTP: concurrency of
independent steps, failure isolation, limits, retries, cache and budgets."""

from __future__ import annotations

import json
import time

import orjson
import pyarrow.parquet as pq
import pytest

from conductor.execute.call import _retry_after
from conductor.planners.base import PlanDraft
from conductor.runner import RunConfig, run_all
from tests.conftest import cli, run_cli, worker, write_pool


class FixedPlanner:
    """Writes the same shape of plan for every query, to test the executor alone."""

    name = "fixed"

    def __init__(self, steps):
        self.steps = steps

    def plan(self, queries, pool, samples):
        return [[PlanDraft(text=json.dumps({"steps": self.steps(q)}))] * samples for q in queries]


def solve(worker_id, access=()):
    return lambda q: [{"worker": worker_id, "instruction": f"{q.prompt}\nEnd with 'Answer: ...'", "access": list(access)}]


def run(tmp_path, pool, queries, planner=None, **kw):
    cfg = RunConfig(queries=queries, pool=pool, data_dir=tmp_path / "data", progress=False, **kw)
    summary = run_all(cfg, planner=planner)
    out = tmp_path / "data" / "runs" / summary["run_id"]
    return summary, pq.read_table(out / "traces.parquet").to_pylist(), pq.read_table(out / "results.parquet").to_pylist()


def _interval(t):
    end = t["ended_at"].timestamp()
    return end - t["latency_s"], end


def max_overlap(intervals):
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


# ---- plans and steps --------------------------------------------------------

def test_independent_steps_run_concurrently_and_the_last_waits(tmp_path, fresh_sim, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("slow", "fast"),
                      providers={"sim": {"max_concurrency": 256}})
    planner = FixedPlanner(lambda q: [
        {"worker": "slow", "instruction": q.prompt, "access": []},
        {"worker": "slow", "instruction": q.prompt + "\nShow your work.", "access": []},
        {"worker": "slow", "instruction": q.prompt + "\nBe brief.", "access": []},
        {"worker": "fast", "instruction": "Which answer above is right? End with 'Answer: ...'", "access": "all"},
    ])
    queries = _unique_prompts(tmp_path, sample_queries, 8)
    _, traces, results = run(tmp_path, pool, queries, planner)
    assert {r["status"] for r in results} == {"ok"}
    by_plan = {}
    for t in traces:
        by_plan.setdefault(t["plan_id"], {})[t["step"]] = t
    for steps in by_plan.values():
        first = [_interval(steps[i]) for i in range(3)]
        assert max_overlap(first) == 3  # the three independent steps were in flight together
        assert steps[3]["started_at"].timestamp() >= max(b for _, b in first) - 1e-3


def test_a_failing_call_fails_its_plan_not_the_batch(tmp_path, fresh_sim, sample_queries):
    url = fresh_sim.url
    # The server lists "weak" among its models (so the preflight lets it through) but answers 404.
    fresh_sim.set_faults("weak", fail_status=404)
    pool = write_pool(tmp_path / "pool.yaml", url, workers=[worker("fast", url), worker("weak", url)])
    planner = FixedPlanner(lambda q: solve("weak" if q.index % 3 == 0 else "fast")(q))
    summary, traces, results = run(tmp_path, pool, sample_queries, planner)
    ghost = [r for r in results if r["query_index"] % 3 == 0]
    assert {r["status"] for r in ghost} == {"error"}
    assert all("worker weak" in r["error"] and "404" in r["error"] for r in ghost)
    assert {r["status"] for r in results if r["query_index"] % 3} == {"ok"}
    assert summary["statuses"] == {"error": 20, "ok": 40}


# ---- limits -----------------------------------------------------------------

def _unique_prompts(tmp_path, sample_queries, n):
    t = pq.read_table(sample_queries).slice(0, n)
    path = tmp_path / f"q{n}.parquet"
    pq.write_table(t, path)
    return path


@pytest.mark.slow  # waits on the clock
def test_requests_per_minute_limit_holds_the_rate(tmp_path, fresh_sim, sample_queries):
    rpm = 600  # 10 per second
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",),
                      providers={"sim": {"rpm": rpm, "max_concurrency": 32}})
    _, traces, _ = run(tmp_path, pool, sample_queries, FixedPlanner(solve("fast")), cache=False)
    assert len(fresh_sim.log()["accepted_times"]["fast"]) == 60
    assert fresh_sim.log()["by_status"] == {"200": 60}
    # The limiter's contract, on the times it let each call go (client side, as the traces
    # see them): any stretch of calls fits in the burst plus the paced rate, give or take the
    # 1 s of jitter (_JITTER_S) the pacing leaves room for. A loaded machine only delays
    # calls. The server's arrival times were used before, with the first arrival as the
    # start: they looked faster than the limit (10.6/s against 10) when the first call's
    # set-up held the event loop ~0.3 s, so the burst and the next calls arrived together.
    released = sorted(_interval(t)[0] for t in traces)
    burst = max(1, rpm // 100)
    per_s = (rpm - burst) / 61.0
    for i in range(len(released)):
        for j in range(i + 1, len(released)):
            assert j - i + 1 <= burst + per_s * (released[j] - released[i] + 1.0), (i, j)


@pytest.mark.slow  # waits on the clock
def test_tokens_per_minute_limit_holds_the_rate(tmp_path, fresh_sim, sample_queries):
    tpm = 60_000  # 1,000 tokens per second
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",),
                      providers={"sim": {"tpm": tpm, "max_concurrency": 32}})
    _, traces, _ = run(tmp_path, pool, sample_queries, FixedPlanner(solve("fast")), cache=False)
    traces.sort(key=lambda t: t["ended_at"])
    tokens = [t["prompt_tokens"] + t["completion_tokens"] for t in traces]
    span = traces[-1]["ended_at"].timestamp() - _interval(traces[0])[0]
    # The bucket starts with a small burst; after it, actual usage drains it at the limit.
    rate = sum(tokens) / span
    assert rate <= 1.1 * tpm / 60 + tpm / 100 / span, rate
    # No lower bound: a loaded machine only makes the rate lower (throughput lives in bench/).


def test_calls_in_flight_are_capped(tmp_path, fresh_sim, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("slow",),
                      providers={"sim": {"max_concurrency": 3}})
    queries = _unique_prompts(tmp_path, sample_queries, 12)
    t0 = time.monotonic()
    _, traces, _ = run(tmp_path, pool, queries, FixedPlanner(solve("slow")), cache=False)
    assert max_overlap([_interval(t) for t in traces]) == 3
    assert time.monotonic() - t0 >= 4 * 0.3 - 0.05


# ---- retries ----------------------------------------------------------------

RETRY_CLASSES = {
    "429 with Retry-After": {"rate_limit_rate": 0.2},
    "5xx": {"error_rate": 0.4},
    "timeout": {"hang_rate": 0.2, "hang_s": 3},
    "dropped connection": {"drop_rate": 0.3},
}


@pytest.mark.parametrize("name", sorted(RETRY_CLASSES))
def test_each_retry_class_is_retried_until_every_call_completes(tmp_path, fresh_sim, sample_queries, name):
    fresh_sim.set_faults("flaky", **RETRY_CLASSES[name])
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("flaky",),
                      providers={"sim": {"max_concurrency": 16, "timeout_s": 1, "max_attempts": 10}})
    queries = _unique_prompts(tmp_path, sample_queries, 30)
    _, traces, results = run(tmp_path, pool, queries, FixedPlanner(solve("flaky")), cache=False)
    assert [r["status"] for r in results] == ["ok"] * 30
    assert len({r["plan_id"] for r in results}) == 30
    retried = [t for t in traces if t["attempts"] > 1]
    assert retried, "the fault never struck"
    log = fresh_sim.log()
    assert log["total"] == sum(t["attempts"] for t in traces)  # attempts are counted exactly
    if name == "429 with Retry-After":
        for t in retried:  # the server asked for 1 s between attempts
            assert (t["ended_at"] - t["started_at"]).total_seconds() >= 1.0 * (t["attempts"] - 1)


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_client_errors_are_not_retried_and_name_the_worker(tmp_path, fresh_sim, sample_queries, status):
    fresh_sim.set_faults("fast", fail_status=status)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",),
                      providers={"sim": {"max_concurrency": 4, "api_key_env": "CONDUCTOR_TEST_SIM_KEY"}})
    queries = _unique_prompts(tmp_path, sample_queries, 10)
    import os

    os.environ["CONDUCTOR_TEST_SIM_KEY"] = "not-a-real-key-0001"
    try:
        _, traces, results = run(tmp_path, pool, queries, FixedPlanner(solve("fast")), cache=False)
    finally:
        del os.environ["CONDUCTOR_TEST_SIM_KEY"]
    assert {r["status"] for r in results} == {"error"}
    assert all(t["attempts"] <= 1 for t in traces)
    assert fresh_sim.log()["total"] == sum(t["attempts"] for t in traces)
    for r in results:
        assert "worker fast" in r["error"]
        if status == 401:
            assert "rejected the API key from environment variable CONDUCTOR_TEST_SIM_KEY" in r["error"]
        if status == 403:  # this worker refused, in the provider's words; not the key for the whole provider
            assert ("refused this worker's requests (does the key in CONDUCTOR_TEST_SIM_KEY have access to this "
                    "model?): HTTP 403: Simulated failure") in r["error"], r["error"]
        assert "not-a-real-key-0001" not in r["error"]


def test_a_key_rejected_on_one_worker_is_named_as_the_reason_on_the_others(tmp_path, fresh_sim, sample_queries):
    """A 401 stops the provider's calls, its other workers' too; their rows showed the first
    worker's message as if they had sent it (audit47 F5)."""
    import os

    fresh_sim.set_faults("fast", fail_status=401, latency_ms=0)
    fresh_sim.set_faults("weak", latency_ms=400)  # fast's 401 comes first
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast", "weak"),
                      providers={"sim": {"max_concurrency": 2, "api_key_env": "CONDUCTOR_TEST_SIM_KEY"}})
    queries = _unique_prompts(tmp_path, sample_queries, 10)
    os.environ["CONDUCTOR_TEST_SIM_KEY"] = "not-a-real-key-0001"
    try:
        _, traces, _ = run(tmp_path, pool, queries, FixedPlanner(lambda q: solve("fast" if q.index % 2 else "weak")(q)),
                           cache=False)
    finally:
        del os.environ["CONDUCTOR_TEST_SIM_KEY"]
    unsent = [t for t in traces if t["worker"] == "weak" and t["status"] == "error" and not t["attempts"]]
    assert unsent, "every weak call went out before fast's 401"
    for t in unsent:
        assert t["error"].startswith("worker weak (openai/weak): not sent: provider sim's key was rejected on "
                                     "another worker: worker fast (openai/fast): the provider rejected"), t["error"]


def test_retry_after_headers_are_read_in_every_form():
    assert _retry_after({"retry-after-ms": "250", "retry-after": "3"}) == 0.25
    assert _retry_after({"retry-after": "2"}) == 2.0
    from email.utils import formatdate

    assert 8 <= _retry_after({"retry-after": formatdate(time.time() + 10, usegmt=True)}) <= 10
    assert _retry_after({}) is None
    # Nonsense is no instruction (the executor backs off as usual), never "retry now" or "wait for ever".
    for nonsense in ({"retry-after": "-5"}, {"retry-after": "inf"}, {"retry-after-ms": "NaN"},
                     {"retry-after": "abc"}):
        assert _retry_after(nonsense) is None, nonsense


# ---- cache ------------------------------------------------------------------

def test_cache_hits_cost_nothing_and_refresh_calls_again(tmp_path, fresh_sim, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    s1, t1, _ = run(tmp_path, pool, sample_queries, run_id="one")
    sent = fresh_sim.log()["total"]
    assert sent == s1["calls"] > 0
    s2, t2, r2 = run(tmp_path, pool, sample_queries, run_id="two")
    assert fresh_sim.log()["total"] == sent  # served entirely from the cache
    assert all(t["cache_hit"] and t["cost_usd"] == 0 and t["attempts"] == 0 for t in t2)
    first_cost = {(t["plan_id"], t["step_path"]): t["cost_usd"] for t in t1}
    assert all(t["original_cost_usd"] == pytest.approx(first_cost[(t["plan_id"], t["step_path"])]) for t in t2)
    assert [t["response_text"] for t in t2] == [t["response_text"] for t in t1]
    assert s2["cost_usd"] == 0
    s3, t3, _ = run(tmp_path, pool, sample_queries, run_id="three", refresh=True)
    assert fresh_sim.log()["total"] == 2 * sent
    assert not any(t["cache_hit"] for t in t3)


def test_an_answer_without_text_in_an_older_cache_is_asked_for_again(tmp_path, fresh_sim, sample_queries):
    """Older versions cached a 200 whose content was null (a refusal); served from the cache, it was
    an answer of no text for ever after."""
    import sqlite3

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    s1, t1, _ = run(tmp_path, pool, sample_queries, run_id="one")
    sent = fresh_sim.log()["total"]
    db = sqlite3.connect(tmp_path / "data" / "cache.sqlite")
    [(key, value)] = db.execute("SELECT key, value FROM responses LIMIT 1").fetchall()
    db.execute("UPDATE responses SET value = ? WHERE key = ?", (orjson.dumps({**orjson.loads(value), "text": None}), key))
    db.commit()
    db.close()
    s2, t2, _ = run(tmp_path, pool, sample_queries, run_id="two")
    assert fresh_sim.log()["total"] == sent + 1  # that one step, and only it, sent again
    assert s2["failed_plans"] == 0 and all(isinstance(t["response_text"], str) for t in t2)
    assert sum(not t["cache_hit"] for t in t2) == 1


def test_a_rerun_of_multi_step_plans_is_served_from_the_cache_and_a_new_step_is_still_called(
        tmp_path, fresh_sim, sample_queries):
    """Plans the caches answer whole are written in bulk (conductor.execute.cached): a step
    that reads an earlier output is looked up once that output is known. A plan with one
    step not cached runs as usual: its cached steps are hits, the new one is called."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)

    def two(q):
        return [{"worker": "fast", "instruction": f"{q.prompt}\nEnd with 'Answer: ...'", "access": []},
                {"worker": "fast", "instruction": "Check the answer above. End with 'Answer: ...'", "access": [0]}]

    def three(q):
        return two(q) + [{"worker": "weak", "instruction": "Say it once more. End with 'Answer: ...'", "access": [1]}]

    def key(t):
        return t["plan_id"], t["step_path"]

    s1, t1, r1 = run(tmp_path, pool, sample_queries, FixedPlanner(two), run_id="one")
    sent = fresh_sim.log()["total"]
    assert sent == s1["calls"] == len(t1) > 0
    s2, t2, r2 = run(tmp_path, pool, sample_queries, FixedPlanner(two), run_id="two")
    assert fresh_sim.log()["total"] == sent  # not one request
    assert all(t["cache_hit"] and t["attempts"] == 0 and t["cost_usd"] == 0 and t["status"] == "ok" for t in t2)
    assert {key(t): t["response_text"] for t in t2} == {key(t): t["response_text"] for t in t1}
    # every other field as the first run wrote it, but those a hit sets (rows are built from a copy)
    hit_fields = {"run_id", "attempts", "cache_hit", "cost_usd", "started_at", "ended_at"}
    first = {key(t): {k: v for k, v in t.items() if k not in hit_fields} for t in t1}
    assert {key(t): {k: v for k, v in t.items() if k not in hit_fields} for t in t2} == first
    assert {r["query_id"]: r["final_answer"] for r in r2} == {r["query_id"]: r["final_answer"] for r in r1}
    assert {(r["plan_id"], r["status"], r["calls"], r["cache_hits"], r["cost_usd"]) for r in r2} == {
        (r["plan_id"], "ok", 0, 2, 0) for r in r1}
    assert s2["cost_usd"] == 0
    s3, t3, _ = run(tmp_path, pool, sample_queries, FixedPlanner(three), run_id="three")
    called = [t for t in t3 if not t["cache_hit"]]
    assert called and {t["step_path"] for t in called} == {"2"}  # only new third steps were called
    assert fresh_sim.log()["total"] == sent + len(called)  # (identical ones once: shared in flight)
    assert len(t3) == 3 * len({t["plan_id"] for t in t1}) and {t["status"] for t in t3} == {"ok"}


def test_cache_key_covers_system_prompt_and_api_base(tmp_path, fresh_sim, sample_queries):
    url = fresh_sim.url
    queries = _unique_prompts(tmp_path, sample_queries, 5)
    base = worker("fast", url)
    variants = [base, {**base, "system": "You are terse."}, {**base, "api_base": url.replace("127.0.0.1", "localhost")},
                {**base, "params": {"temperature": 0.5, "max_tokens": 256}}]
    for i, w in enumerate(variants):
        pool = write_pool(tmp_path / f"pool{i}.yaml", url, workers=[w])
        _, traces, _ = run(tmp_path, pool, queries, FixedPlanner(solve("fast")), run_id=f"v{i}")
        assert not any(t["cache_hit"] for t in traces), f"variant {i} was served a stale answer"
    assert fresh_sim.log()["total"] == 5 * len(variants)


@pytest.mark.slow  # whole runs through the CLI
def test_concurrent_runs_share_one_cache_file(tmp_path, fresh_sim, sample_queries):
    import subprocess
    import sys

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    data = tmp_path / "data"
    procs = [subprocess.Popen([sys.executable, "-m", "conductor", "run", str(sample_queries), "--pool", str(pool),
                               "--data-dir", str(data), "--run-id", f"par{i}", "--quiet", "--seed", str(i),
                               "--samples", "2", "--planner-option", "temperature=1.0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-2000:] for o in outs]
    import sqlite3

    with sqlite3.connect(data / "cache.sqlite") as db:
        entries = db.execute("SELECT count(*) FROM responses").fetchone()[0]
    log = fresh_sim.log()
    assert entries == len(log["by_body"])  # every distinct request stored once
    r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--run-id", "after", "--samples", "2",
                "--seed", "1", "--quiet", "--planner-option", "temperature=1.0")
    assert r.returncode == 0 and fresh_sim.log()["total"] == log["total"]


# ---- budgets ----------------------------------------------------------------

def _budget_pool(path, url, budget):
    return write_pool(path, url, names=("fast",), providers={"sim": {"budget_usd": budget, "max_concurrency": 16}})


@pytest.mark.slow  # whole runs through the CLI
def test_budget_is_never_exceeded_and_a_larger_budget_finishes_the_run(tmp_path, fresh_sim, sample_queries):
    data = tmp_path / "data"
    pool = _budget_pool(tmp_path / "pool.yaml", fresh_sim.url, 0.004)
    r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--no-cache")
    assert r.returncode == 3, r.stderr
    # the advice goes to stderr, beside exit 4's (audit58 F5): stdout holds the summary only
    assert "plan(s) stopped by a budget" in r.stderr and "rerun the same command" in r.stderr
    assert "rerun the same command" not in r.stdout
    assert "budget provider sim" in r.stdout
    run_dir = next((data / "runs").iterdir())
    traces = pq.read_table(run_dir / "traces.parquet").to_pylist()
    spent = sum(t["cost_usd"] or 0 for t in traces)
    assert 0 < spent <= 0.004
    blocked = [t for t in traces if t["status"] == "budget_exhausted"]
    assert blocked and all(t["attempts"] == 0 for t in blocked)
    paid_bodies = fresh_sim.log()["by_body"]

    _budget_pool(tmp_path / "pool.yaml", fresh_sim.url, 1.0)
    r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--no-cache")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(resumed)" in r.stdout
    assert len(list((data / "runs").iterdir())) == 1
    results = pq.read_table(run_dir / "results.parquet").to_pylist()
    assert len(results) == 60 and {x["status"] for x in results} == {"ok"}
    log = fresh_sim.log()["by_body"]
    assert all(log[b] == 1 for b in paid_bodies)  # nothing paid for was sent again
    assert sum(log.values()) == 60


def test_unpriced_worker_under_a_budget_is_refused_before_any_call(tmp_path, fresh_sim, sample_queries):
    w = worker("fast", fresh_sim.url)
    del w["price"]
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, workers=[w],
                      providers={"sim": {"budget_usd": 1.0}})
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 2
    # before the run folder: adding the price makes a new run, so "plans are saved" saved them for nothing
    assert "no known price for worker(s) fast" in r.stderr and "nothing was written or sent" in r.stderr
    assert fresh_sim.log()["total"] == 0 and not (tmp_path / "data" / "runs").exists()


def test_an_answer_paid_for_but_never_logged_is_recorded_as_the_paid_call(tmp_path, fresh_sim, sample_queries):
    """A kill between storing a response in the run cache and journaling its row: the resumed
    run must neither send the call again nor lose what it cost."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    first, t1, r1 = run(tmp_path, pool, sample_queries, run_id="killed", cache=False)
    sent = fresh_sim.log()["total"]
    assert sent == first["calls"] > 0
    # The state such a kill leaves: every answer in the run cache, no step or plan row yet.
    runs = tmp_path / "data" / "runs"
    (runs / "resumed" / "work").mkdir(parents=True)
    (runs / "killed" / "work" / "responses.sqlite").rename(runs / "resumed" / "work" / "responses.sqlite")
    second, t2, r2 = run(tmp_path, pool, sample_queries, run_id="resumed", cache=False)
    assert fresh_sim.log()["total"] == sent  # nothing sent again
    assert second["calls"] == first["calls"] and second["cost_usd"] == pytest.approx(first["cost_usd"])
    assert not any(t["cache_hit"] for t in t2) and all(t["attempts"] >= 1 for t in t2)
    paid = {(t["plan_id"], t["step_path"]): t["cost_usd"] for t in t1}
    assert {(t["plan_id"], t["step_path"]): t["cost_usd"] for t in t2} == pytest.approx(paid)
