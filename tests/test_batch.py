"""Batch mode (a provider with `mode: batch`) over real HTTP against the simulated
server's OpenAI Files and Batch API: the same answers as online at the batch price,
one submission per stage, resume after SIGKILL by polling the same batch, failed
and expired lines retried, budgets reserved per batch, cache hits never sent."""

from __future__ import annotations

import re

import orjson
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.errors import PoolError
from conductor.pool import load_pool
from tests.conftest import PRICE_IN, PRICE_OUT, cli, first_queries, kill_when_journaled, worker

@pytest.fixture(scope="module")
def queries(tmp_path_factory, sample_queries):
    return first_queries(tmp_path_factory, sample_queries, 20)


def batch_pool(path, url, **provider):
    """Two workers on one provider; `mode: batch` unless provider says otherwise."""
    cfg = {"max_concurrency": 32, "timeout_s": 10, "mode": "batch", "batch_poll_s": 0.2,
           "batch_collect_s": 0.3, **provider}
    if cfg["mode"] == "online":
        cfg = {k: v for k, v in cfg.items() if not k.startswith("batch_")}
    path.write_text(yaml.safe_dump({"providers": {"sim": cfg},
                                    "workers": [worker(n, url) for n in ("fast", "weak")]}))
    return path


def run(queries, pool, data, *extra, quiet=True):
    """`conductor run` through the CLI's entry function in this process: a new interpreter
    per run (seconds of imports on a busy machine) proves nothing these tests assert."""
    return said(cli, "run", queries, "--pool", pool, *(["--quiet"] if quiet else []), "--data-dir", data, *extra)


def said(command, *args):
    """`command(*args)` with the warnings it logs on its stderr, as a process prints them (logging's
    last resort); under pytest the root logger's handlers are pytest's, which took them away."""
    import io
    import logging

    logged = io.StringIO()
    handler = logging.StreamHandler(logged)
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        r = command(*args)
    finally:
        logging.getLogger().removeHandler(handler)
    r.stderr += logged.getvalue()
    return r


def tables(data):
    run_dir = next((data / "runs").iterdir())
    traces = pq.read_table(run_dir / "traces.parquet").to_pylist()
    results = pq.read_table(run_dir / "results.parquet").to_pylist()
    return traces, results


def answers(traces):
    return {(t["plan_id"], t["step_path"]): t["response_text"] for t in traces}


def billed_usd(tokens: dict) -> float:
    return sum(p * PRICE_IN + c * PRICE_OUT for p, c in tokens.values())


def test_batch_run_answers_as_online_at_half_price_one_submission_per_stage(tmp_path, fresh_sim, queries):
    online = run(queries, batch_pool(tmp_path / "online.yaml", fresh_sim.url, mode="online"),
                 tmp_path / "online", "--no-cache")
    assert online.returncode == 0, online.stderr
    online_log = fresh_sim.log()
    fresh_sim.reset()
    batch = run(queries, batch_pool(tmp_path / "batch.yaml", fresh_sim.url), tmp_path / "batch", "--no-cache")
    assert batch.returncode == 0, batch.stderr
    log = fresh_sim.log()

    on_traces, on_results = tables(tmp_path / "online")
    traces, results = tables(tmp_path / "batch")
    assert answers(traces) == answers(on_traces)
    assert {r["status"] for r in results} == {"ok"}
    # Nothing went online; the plans' two stages (solve, then check) made one batch each.
    assert log["total"] == 0
    assert log["batches_created"] == 2
    assert log["batch_lines"] == {"200": len(traces)}
    # The same tokens, billed at half the price: by the run and by the server's own count.
    assert log["batch_billed_tokens"] == online_log["billed_tokens"]
    cost = sum(r["cost_usd"] for r in results)
    online_cost = sum(r["cost_usd"] for r in on_results)
    assert cost == pytest.approx(online_cost / 2, rel=1e-9)
    assert cost == pytest.approx(billed_usd(log["batch_billed_tokens"]) / 2, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["after journaling the batch", "before journaling the batch it created"])
def test_sigkill_after_submission_resumes_by_polling_the_same_batch(tmp_path, fresh_sim, queries, killed):
    fresh_sim.set_faults(batch_delay_s=2.0)
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url)
    args = ["run", str(queries), "--pool", str(pool), "--quiet", "--no-cache"]
    run_dir = kill_when_journaled(args, tmp_path / "data", 2, journal="work/batches.jsonl")
    assert run_dir is not None, "the run ended before it submitted a batch"
    assert fresh_sim.log()["batches_created"] == 1  # killed while the first stage's batch runs
    if killed.startswith("before"):  # as if killed between the provider's answer and the journal line
        journal = run_dir / "work" / "batches.jsonl"
        lines = journal.read_bytes().splitlines(keepends=True)
        assert [b'"event":"uploaded"' in lines[0], b'"event":"submitted"' in lines[1]] == [True, True]
        journal.write_bytes(lines[0])

    final = said(cli, *args, "--data-dir", tmp_path / "data")
    assert final.returncode == 0, final.stderr
    traces, results = tables(tmp_path / "data")
    assert {r["status"] for r in results} == {"ok"} and len(results) == 20
    log = fresh_sim.log()
    # The resumed run polled the killed run's batch: still one per stage, each input sent once.
    assert log["batches_created"] == 2
    assert set(log["batch_submissions"].values()) == {1}
    assert log["batch_lines"] == {"200": len(traces)}
    assert log["total"] == 0


@pytest.mark.slow  # waits on the clock
@pytest.mark.parametrize("retry", ["online", "batch"])
def test_expired_batch_and_line_errors_are_retried_as_configured(tmp_path, fresh_sim, queries, retry):
    fresh_sim.set_faults(batch_expire=0.25, batch_line_error_rate=0.2)
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url, batch_retry=retry, max_attempts=10)
    done = run(queries, pool, tmp_path / "data", "--no-cache")
    assert done.returncode == 0, done.stderr
    traces, results = tables(tmp_path / "data")
    assert {r["status"] for r in results} == {"ok"}
    log = fresh_sim.log()
    retried = [t for t in traces if t["attempts"] > 1]
    assert retried, "no line failed; the faults did not apply"
    assert log["batch_lines"].get("batch_expired", 0) > 0 and log["batch_lines"].get("500", 0) > 0
    if retry == "online":
        assert log["batches_created"] == 2  # one per stage; every failed line went online
        assert log["total"] == log["by_status"]["200"] + sum(
            n for s, n in log["by_status"].items() if s != "200")
        assert log["by_status"]["200"] == len(retried)
    else:
        assert log["total"] == 0  # nothing online: failed lines went into new batches
        assert log["batches_created"] > 2
    # A retried line is paid at the price of the attempt that answered it.
    for t in retried:
        assert t["cost_usd"] > 0


@pytest.mark.slow  # waits on the clock
def test_batch_waits_longer_than_batch_max_wait_s_are_cancelled_and_retried_online(tmp_path, fresh_sim, queries):
    fresh_sim.set_faults(batch_delay_s=600)
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url, batch_max_wait_s=1.0)
    done = run(queries, pool, tmp_path / "data", "--no-cache", quiet=False)
    assert done.returncode == 0, done.stderr
    # The progress line shows what the run is waiting for.
    assert "[batch batch_" in done.stderr and " 0/20 after 0m0" in done.stderr
    traces, results = tables(tmp_path / "data")
    assert {r["status"] for r in results} == {"ok"}
    log = fresh_sim.log()
    assert log["batch_lines"].get("batch_cancelled", 0) > 0
    assert log["by_status"]["200"] == log["batch_lines"]["batch_cancelled"]


@pytest.mark.slow  # waits on the clock
def test_budget_reserves_the_batch_worst_case_and_refuses_what_does_not_fit(tmp_path, fresh_sim, queries):
    budget = 0.003  # about a third of the first stage's worst case at the batch price
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url, budget_usd=budget)
    run(queries, pool, tmp_path / "data", "--no-cache")
    traces, results = tables(tmp_path / "data")
    statuses = [r["status"] for r in results]
    assert "budget_exhausted" in statuses and "ok" in statuses
    log = fresh_sim.log()
    # What the server billed (at the batch price) stays within the budget, and only the
    # lines that fit were ever sent.
    assert billed_usd(log["batch_billed_tokens"]) / 2 <= budget
    sent = sum(log["batch_lines"].values())
    assert sent == sum(1 for t in traces if t["status"] == "ok" and t["attempts"])
    assert sent < len(results) * 2
    # The refused lines waited for the earlier batches to settle: the run stopped with the
    # budget spent up to less than one line's worst case (at most $0.0012 here), not at a
    # small part of it (audit 28: 8%; here it was 29%).
    assert billed_usd(log["batch_billed_tokens"]) / 2 > budget - 0.0012


@pytest.mark.slow  # waits on the clock
def test_lines_a_budget_cannot_cover_yet_wait_for_a_later_batch(tmp_path, fresh_sim, queries):
    """Worst cases are several times the real cost: what the first batch's reservation
    leaves out goes in later batches once it settles, as an online call waits."""
    budget = 0.006  # 1.5 times the run's real cost, two thirds of the first stage's worst case
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url, budget_usd=budget)
    done = run(queries, pool, tmp_path / "data", "--no-cache")
    assert done.returncode == 0, done.stderr
    traces, results = tables(tmp_path / "data")
    assert {r["status"] for r in results} == {"ok"}
    log = fresh_sim.log()
    assert billed_usd(log["batch_billed_tokens"]) / 2 <= budget
    assert log["batches_created"] > 2  # one per stage would not have fit
    assert log["batch_lines"] == {"200": len(traces)}


@pytest.mark.slow  # waits on the clock
def test_a_line_left_out_of_batch_budget_rounds_batches_is_refused_and_a_rerun_goes_on(tmp_path, fresh_sim, queries):
    """Near the cap each round of batches fits fewer lines, and each round is a whole batch's
    wait (hours at a provider): the demo pool under --budget 0.05 took 83 batches. A line
    left out of batch_budget_rounds of its worker's batches is refused, naming the way out."""
    budget = 0.0045  # the first stage's worst case is $0.0086 at the batch price, the run's real cost $0.004
    unbounded = run(queries, batch_pool(tmp_path / "unbounded.yaml", fresh_sim.url, budget_usd=budget,
                                        batch_budget_rounds=1000), tmp_path / "unbounded", "--no-cache")
    assert unbounded.returncode == 3, unbounded.stderr
    many = fresh_sim.log()["batches_created"]
    fresh_sim.reset()

    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url, budget_usd=budget, batch_budget_rounds=2)
    first = run(queries, pool, tmp_path / "data", "--no-cache", quiet=False)
    assert first.returncode == 3, first.stderr
    log = fresh_sim.log()
    assert log["batches_created"] < many
    assert billed_usd(log["batch_billed_tokens"]) / 2 <= budget
    _, results = tables(tmp_path / "data")
    refused = [r for r in results if r["status"] == "budget_exhausted"]
    assert refused and "ok" in {r["status"] for r in results}
    assert "left out of 2 of its batches for want of budget room (batch_budget_rounds 2)" in first.stdout
    assert "Lower max_tokens, or raise the budget or batch_budget_rounds, and rerun" in first.stdout
    # said while it happens, not only at the end
    assert "the rest wait for batches to end (a line left out of 2 is refused" in first.stderr

    # The budget is the run's across reruns: the same command goes on where it stopped.
    again = run(queries, pool, tmp_path / "data", "--no-cache")
    assert again.returncode in (0, 3), again.stderr
    _, results = tables(tmp_path / "data")
    assert sum(r["status"] == "budget_exhausted" for r in results) < len(refused)
    assert billed_usd(fresh_sim.log()["batch_billed_tokens"]) / 2 <= budget


@pytest.mark.slow  # waits on the clock
def test_the_workers_of_a_stage_send_their_batches_side_by_side_under_a_budget(tmp_path, fresh_sim, queries):
    """Both workers of a stage get a share of the budget's room and submit at once: the
    second used to wait for the first batch to end (hours, with a real provider)."""
    fresh_sim.set_faults(batch_delay_s=3.0)
    budget = 0.014  # covers each worker's first-stage worst case ($0.0086), not both
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url, budget_usd=budget)
    # every plan: fast and weak answer (one stage, two batches), then fast judges
    done = run(queries, pool, tmp_path / "data", "--no-cache", "--planner-option", "policy=none",
               "--planner-option", "action=ensemble:fast+weak>fast")
    assert done.returncode == 0, done.stderr
    _, results = tables(tmp_path / "data")
    assert {r["status"] for r in results} == {"ok"}
    assert billed_usd(fresh_sim.log()["batch_billed_tokens"]) / 2 <= budget
    journal = next((tmp_path / "data" / "runs").iterdir()) / "work" / "batches.jsonl"
    events = [(r["event"], r.get("worker")) for r in map(orjson.loads, journal.read_bytes().splitlines())
              if r["event"] in ("submitted", "done")]
    assert sorted(events[:2]) == [("submitted", "fast"), ("submitted", "weak")], events


@pytest.mark.slow  # waits on the clock
def test_cache_hits_never_enter_a_batch(tmp_path, fresh_sim, queries):
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url)
    half = tmp_path / "q10.parquet"
    pq.write_table(pq.read_table(queries).slice(0, 10), half)
    first = run(half, pool, tmp_path / "data")
    assert first.returncode == 0, first.stderr
    fresh_sim.reset()
    second = run(queries, pool, tmp_path / "data")  # 10 of its 20 queries are cached
    assert second.returncode == 0, second.stderr
    log = fresh_sim.log()
    run_dir = [d for d in (tmp_path / "data" / "runs").iterdir() if d.name != first.stdout.split()[1]]
    traces = pq.read_table(run_dir[0] / "traces.parquet").to_pylist()
    hits = [t for t in traces if t["cache_hit"]]
    assert len(hits) == 20
    assert sum(log["batch_lines"].values()) == len(traces) - len(hits) == 20
    assert log["batches_created"] == 2


@pytest.mark.parametrize("provider, message", [
    ({"mode": "bulk"}, "providers.sim.mode: must be one of online, batch (got 'bulk')"),
    ({"batch_poll_s": 5}, "providers.sim.batch_poll_s: only applies with mode: batch"),
    ({"mode": "batch", "batch_price_factor": 2}, "providers.sim.batch_price_factor: must be at most 1"),
    ({"mode": "batch", "batch_retry": "never"}, "providers.sim.batch_retry: must be one of online, batch"),
    ({"mode": "batch", "batch_poll_s": 0}, "providers.sim.batch_poll_s: must be greater than 0"),
    ({"mode": "batch", "batch_max_requests": 2.5}, "providers.sim.batch_max_requests: must be a whole number"),
    ({"mode": "batch", "batch_budget_rounds": 0}, "providers.sim.batch_budget_rounds: must be greater than 0"),
    ({"mode": "batch", "batch_completion_window": "1d"}, "providers.sim.batch_completion_window: must be hours"),
])
def test_bad_batch_options_are_refused_naming_the_file_and_key(tmp_path, provider, message):
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"providers": {"sim": provider},
                                    "workers": [worker("fast", "http://127.0.0.1:9/v1")]}))
    with pytest.raises(PoolError) as e:
        load_pool(path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_a_batch_provider_needs_an_openai_compatible_model(tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"providers": {"anth": {"mode": "batch"}},
                                    "workers": [{"id": "c", "model": "anthropic/claude-3-5-haiku",
                                                 "provider": "anth"}]}))
    with pytest.raises(PoolError, match=r"workers\[0\] \(c\)\.model: provider anth has mode: batch"):
        load_pool(path)


@pytest.mark.slow  # waits on the clock
@pytest.mark.parametrize("retry", ["online", "batch"])
def test_a_failed_batch_is_retried_and_its_error_is_named(tmp_path, fresh_sim, queries, retry):
    fresh_sim.set_faults(batch_fail_rate=1.0)  # every batch fails validation
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url, batch_retry=retry, max_attempts=2)
    run(queries, pool, tmp_path / "data", "--no-cache")
    traces, results = tables(tmp_path / "data")
    log = fresh_sim.log()
    if retry == "online":  # each line's second attempt goes online and is answered
        assert {r["status"] for r in results} == {"ok"}
        assert log["by_status"] == {"200": len(traces)}
        assert {t["attempts"] for t in traces} == {2}
    else:  # a new batch fails too, and the step gives up after max_attempts with the provider's reason
        assert {r["status"] for r in results} == {"error"}
        assert log["total"] == 0
        first = [t for t in traces if t["step_path"] == "0"]
        assert {t["attempts"] for t in first} == {2}
        assert all("gave up after 2 attempts" in t["error"] and "failed validation" in t["error"] for t in first)


def test_a_batch_the_provider_refuses_to_create_is_retried_by_the_rerun_after_the_fix(tmp_path, fresh_sim, queries):
    """A completion window the provider does not take (OpenAI and the sim: only 24h) failed
    every plan for good: a rerun after fixing the pool file did nothing without --retry-failed."""
    bad = run(queries, batch_pool(tmp_path / "pool.yaml", fresh_sim.url, batch_completion_window="48h"),
              tmp_path / "data", "--no-cache")
    assert bad.returncode == 4, bad.stderr
    traces, results = tables(tmp_path / "data")
    assert {r["status"] for r in results} == {"error"}
    first = [t for t in traces if t["status"] == "error"]
    assert {t["failure"] for t in first} == {"batch_refused"}
    assert "no line of it ran: check provider sim's batch_* options in the pool file" in first[0]["error"]
    assert "a rerun retries these" in bad.stdout

    fixed = run(queries, batch_pool(tmp_path / "pool.yaml", fresh_sim.url), tmp_path / "data", "--no-cache")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    _, results = tables(tmp_path / "data")
    assert {r["status"] for r in results} == {"ok"} and len(results) == 20


@pytest.mark.slow  # waits on the clock
def test_a_line_answered_400_fails_its_step_without_retry(tmp_path, fresh_sim, queries):
    fresh_sim.set_faults("weak", fail_status=400)  # the checking step's worker
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url)
    run(queries, pool, tmp_path / "data", "--no-cache")
    traces, results = tables(tmp_path / "data")
    assert {r["status"] for r in results} == {"error"}
    checks = [t for t in traces if t["worker"] == "weak"]
    assert checks and all(t["status"] == "error" and t["attempts"] == 1 and "HTTP 400 (in a batch)" in t["error"]
                          for t in checks)
    assert fresh_sim.log()["total"] == 0  # nothing retried online


@pytest.mark.slow
def test_a_resumed_batch_under_a_budget_is_counted_once(tmp_path, fresh_sim, queries):
    fresh_sim.set_faults(batch_delay_s=2.0)
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url, budget_usd=1.0)
    args = ["run", str(queries), "--pool", str(pool), "--quiet", "--no-cache"]
    assert kill_when_journaled(args, tmp_path / "data", 2, journal="work/batches.jsonl") is not None
    final = said(cli, *args, "--data-dir", tmp_path / "data")
    assert final.returncode == 0, final.stderr
    traces, results = tables(tmp_path / "data")
    assert {r["status"] for r in results} == {"ok"}
    log = fresh_sim.log()
    assert log["batches_created"] == 2
    billed = billed_usd(log["batch_billed_tokens"]) / 2
    manifest = orjson.loads((next((tmp_path / "data" / "runs").iterdir()) / "manifest.json").read_bytes())
    spent = {s["cap"]: s["spent_usd"] for s in manifest["spend"]}
    # What the provider's cap counts is what the server billed at the batch price, not twice
    # the first batch (journaled by the killed run, polled by the rerun) and no reservation left.
    assert spent["provider sim"] == pytest.approx(billed, abs=1e-6)
    assert sum(r["cost_usd"] for r in results) == pytest.approx(billed, rel=1e-9)


def test_a_batch_larger_than_an_input_file_may_be_is_split_by_size():
    from conductor.execute.batchfiles import split_by_size

    lines = [(f"k{i}", None, b"x" * n) for i, n in enumerate([40, 40, 30, 90, 150, 10])]
    parts = split_by_size(lines, 100)
    assert [[k for k, _, _ in p] for p in parts] == [["k0", "k1"], ["k2"], ["k3"], ["k4"], ["k5"]]
    assert all(sum(len(b) for _, _, b in p) <= 100 for p in parts if len(p) > 1)


@pytest.mark.slow
def test_a_provider_that_stops_answering_during_a_batch_is_said(tmp_path, fresh_sim, queries):
    """Checking a batch that failed again and again was retried in silence, for up to
    batch_max_wait_s (a day by default): no line named the provider (audit 28)."""
    import urllib.error
    import urllib.request

    from tests.fakehttp import LoopbackServer, QuietHandler

    refused = []

    class Proxy(QuietHandler):  # the sim, but checking a batch fails the first 12 times
        def _forward(self, method):
            body = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else None
            if method == "GET" and "/batches/" in self.path and len(refused) < 12:
                refused.append(self.path)
                return self.send(503, {"error": {"message": "down for maintenance"}})
            req = urllib.request.Request(fresh_sim.url.rsplit("/v1", 1)[0] + self.path, data=body, method=method,
                                         headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    status, data, ctype = r.status, r.read(), r.headers.get("content-type", "application/json")
            except urllib.error.HTTPError as e:
                status, data, ctype = e.code, e.read(), e.headers.get("content-type", "application/json")
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._forward("GET")

        def do_POST(self):
            self._forward("POST")

    with LoopbackServer(Proxy) as proxy:
        pool = batch_pool(tmp_path / "pool.yaml", f"{proxy.root}/v1", max_attempts=2)
        r = run(queries, pool, tmp_path / "data", "--no-cache", quiet=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(refused) == 12
    assert re.search(rf"batch \S+ of worker \w+: cannot check it at {re.escape(proxy.root)}/v1 \(.*503", r.stderr), \
        r.stderr
    assert "the provider answers again after" in r.stderr
