"""A provider bills an answer it will not give: a refusal or a content filter answers
200 with `content: null` and the usage of the request. The step fails (nothing to
keep or cache), but what the provider billed is charged to the step, the plan, the
summary and the budget, online (the direct client and litellm) and in batch mode.
Checked against the simulated server's own count of billed tokens."""

from __future__ import annotations

import orjson
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import PRICE_IN, PRICE_OUT, first_queries, run_cli, worker

@pytest.fixture(scope="module")
def queries(tmp_path_factory, sample_queries):
    return first_queries(tmp_path_factory, sample_queries, 20)


def pool_file(path, url, prefix="openai", **provider):
    workers = [worker(n, url, model=f"{prefix}/{n}") for n in ("fast", "weak")]
    path.write_text(yaml.safe_dump({"providers": {"sim": {"max_concurrency": 16, "timeout_s": 10, **provider}},
                                    "workers": workers}))
    return path


def usd(tokens: dict, factor: float = 1.0) -> float:
    return sum(p * PRICE_IN + c * PRICE_OUT for p, c in tokens.values()) * factor


@pytest.mark.parametrize("route", ["direct", "litellm", "batch"])
def test_a_refused_call_is_charged_what_the_provider_billed(tmp_path, fresh_sim, queries, route):
    fresh_sim.set_faults(refusal_rate=0.4)
    provider = {"mode": "batch", "batch_poll_s": 0.2, "batch_collect_s": 0.3} if route == "batch" else {}
    pool = pool_file(tmp_path / "pool.yaml", fresh_sim.url, "hosted_vllm" if route == "litellm" else "openai",
                     **provider)
    data = tmp_path / "data"
    r = run_cli("run", queries, "--pool", pool, "--quiet", "--no-cache", "--data-dir", data,
                "--max-failed-share", "1", "--budget", "5")
    assert r.returncode == 0, r.stderr
    run_dir = next((data / "runs").iterdir())
    traces = pq.read_table(run_dir / "traces.parquet").to_pylist()
    results = pq.read_table(run_dir / "results.parquet").to_pylist()
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    log = fresh_sim.log()

    refused = [t for t in traces if t["status"] == "error"]
    assert refused and all(t["failure"] == "malformed" and "no text content" in t["error"] for t in refused)
    assert all(t["cost_usd"] > 0 and t["prompt_tokens"] > 0 and t["completion_tokens"] > 0 for t in refused)
    factor = 0.5 if route == "batch" else 1.0
    assert all(t["cost_usd"] == pytest.approx(
        (t["prompt_tokens"] * PRICE_IN + t["completion_tokens"] * PRICE_OUT) * factor, rel=1e-9) for t in refused)
    billed = usd(log["batch_billed_tokens"], 0.5) if route == "batch" else usd(log["billed_tokens"])
    charged = sum(t["cost_usd"] or 0 for t in traces)  # skipped after a failed step: null
    # Every token the server billed is charged: answers and refusals alike.
    assert charged == pytest.approx(billed, rel=1e-9)
    assert sum(r["cost_usd"] for r in results) == pytest.approx(billed, rel=1e-9)
    assert summary["cost_usd"] == pytest.approx(billed, rel=1e-9)
    spend = {c["cap"]: c["spent_usd"] for c in summary["spend"]}
    assert spend["run"] == pytest.approx(billed, abs=1e-6)  # shown to the micro-dollar
    # A refusal is final, not sent again, and not cached: the plan failed and says why.
    failed = {t["plan_id"] for t in refused}
    assert all(r["status"] == "error" for r in results if r["plan_id"] in failed)

    # The same command again sends nothing and counts each refusal once: its step row names
    # the request, so the journal's settled reservation is not taken for a call lost in flight.
    fresh_sim.reset()
    again = run_cli("run", queries, "--pool", pool, "--no-cache", "--data-dir", data, "--max-failed-share", "1",
                    "--budget", "5")
    assert again.returncode == 0 and "lost in flight" not in again.stdout, again.stdout + again.stderr
    assert fresh_sim.log()["total"] == 0
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert {c["cap"]: c["spent_usd"] for c in summary["spend"]}["run"] == pytest.approx(billed, abs=1e-6)
    assert summary["cost_usd"] == pytest.approx(billed, rel=1e-9)


def test_retrying_refused_steps_adds_to_what_they_cost(tmp_path, fresh_sim, queries):
    """--retry-failed asks a refused step again: its row is the new answer's, and the plan's cost
    holds both calls (the refusal was billed too)."""
    fresh_sim.set_faults(refusal_rate=0.4)
    pool = pool_file(tmp_path / "pool.yaml", fresh_sim.url)
    data = tmp_path / "data"
    args = ["run", queries, "--pool", pool, "--quiet", "--no-cache", "--data-dir", data, "--max-failed-share", "1"]
    assert run_cli(*args).returncode == 0
    fresh_sim.clear_faults()
    r = run_cli(*args, "--retry-failed")
    assert r.returncode == 0, r.stdout + r.stderr
    billed = usd(fresh_sim.log()["billed_tokens"])  # the log was kept across both runs
    run_dir = next((data / "runs").iterdir())
    traces = pq.read_table(run_dir / "traces.parquet").to_pylist()
    results = pq.read_table(run_dir / "results.parquet").to_pylist()
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert {r["status"] for r in results} == {"ok"}
    assert sum(t["cost_usd"] or 0 for t in traces) == pytest.approx(billed, rel=1e-9)
    assert summary["cost_usd"] == pytest.approx(billed, rel=1e-9)


@pytest.mark.parametrize("usage_factor", [-1.0, 0.5e9])
def test_a_refusal_with_usage_past_belief_is_charged_the_requests_bounds(tmp_path, fresh_sim, queries, usage_factor):
    """A refusal whose usage is negative (unreadable) was charged $0, and a budget did not hold;
    one whose usage is far past what the request could use is clamped, as an answer is."""
    fresh_sim.set_faults(refusal_rate=1.0, usage_factor=usage_factor)
    pool = pool_file(tmp_path / "pool.yaml", fresh_sim.url, max_concurrency=2)
    data = tmp_path / "data"
    r = run_cli("run", queries, "--pool", pool, "--quiet", "--no-cache", "--data-dir", data,
                "--max-failed-share", "1", "--budget", "0.0015")
    assert r.returncode in (0, 3), r.stdout + r.stderr
    billed = usd(fresh_sim.log()["billed_tokens"])
    assert 0 < billed <= 0.0015
    traces = pq.read_table(next((data / "runs").iterdir()) / "traces.parquet").to_pylist()
    refused = [t for t in traces if t["status"] == "error"]
    assert refused and all(t["usage_estimated"] and t["cost_usd"] > 0 for t in refused)
    assert sum(t["cost_usd"] for t in refused) >= billed  # the request's bounds: never below the bill


def test_a_budget_stops_once_refusals_have_spent_it(tmp_path, fresh_sim, queries):
    """Refusals alone spend the cap: the run stops sending, and never overspends by more
    than the calls in flight could."""
    fresh_sim.set_faults(refusal_rate=1.0)
    pool = pool_file(tmp_path / "pool.yaml", fresh_sim.url, max_concurrency=2)
    data = tmp_path / "data"
    r = run_cli("run", queries, "--pool", pool, "--quiet", "--no-cache", "--data-dir", data / "all",
                "--max-failed-share", "1")
    assert r.returncode == 0, r.stderr
    all_refused = usd(fresh_sim.log()["billed_tokens"])
    assert all_refused > 0
    fresh_sim.reset()
    cap = all_refused / 3
    r = run_cli("run", queries, "--pool", pool, "--quiet", "--no-cache", "--data-dir", data / "capped",
                "--max-failed-share", "1", "--budget", f"{cap:.10f}")
    assert r.returncode == 3, r.stdout + r.stderr  # some plans stopped by the budget
    billed = usd(fresh_sim.log()["billed_tokens"])
    assert 0 < billed <= cap + 1e-12
    run_dir = next((data / "capped" / "runs").iterdir())
    traces = pq.read_table(run_dir / "traces.parquet").to_pylist()
    assert sum(t["cost_usd"] or 0 for t in traces) == pytest.approx(billed, rel=1e-9)
