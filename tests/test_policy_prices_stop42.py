"""The prices `policy train` records for a run served from the response cache after a price
change (audit69 F5): a cache hit logs the cost first paid for its answer, so the artifact must
record the price that cost was paid at, not the run's new pool price. One small simulated pool;
runs of 20 and 30 queries, trained in a fraction of a second. Since stop 43 a cache entry keeps the
price it was paid at (tests/test_cache_prices_stop43.py); the `one_call` and `batched` fixtures strip
it from their caches, as versions before wrote them, so the price is read back from the costs."""

from __future__ import annotations

import sqlite3

import orjson
import pyarrow.parquet as pq
import pytest

from conductor.policy import artifact
from conductor.pool import load_pool
from conductor.runner import RunConfig, run_all
from tests.conftest import SAMPLE, cli, worker, write_pool
from tests.test_policy_inputs import sim_server

CACHED = "served from the response cache at the cost first paid, at $1/$2, not the run's pool price $100/$200"


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Pool A (fast, weak at $1/$2) and its copy with weak at $100/$200 (same pool key). Run
    `first` pays for 20 queries under A; `again` repeats it under the dear copy (answers from
    the cache); `same` repeats it under A; `more` adds 10 new queries under the dear copy."""
    from conductor.sim import start_sim

    d = tmp_path_factory.mktemp("prices42")
    table = pq.read_table(SAMPLE)
    queries, wider = d / "queries.parquet", d / "wider.parquet"
    pq.write_table(table.slice(0, 20), queries)
    pq.write_table(table.slice(0, 30), wider)
    with start_sim(sim_server(d), [wider]) as sim:
        pool = write_pool(d / "a.yaml", sim.url)
        dear = [worker(n, sim.url) for n in ("fast", "weak")]
        dear[1]["price"] = {"input_per_mtok": 100.0, "output_per_mtok": 200.0}
        dear_pool = write_pool(d / "dear.yaml", sim.url, workers=dear)
        options = {"policy": "none", "candidates": "bandit", "explore": 1.0}
        for run_id, q, p in (("first", queries, pool), ("again", queries, dear_pool), ("same", queries, pool),
                             ("more", wider, dear_pool)):
            run_all(RunConfig(queries=q, pool=p, data_dir=d / "data", run_id=run_id, samples=4,
                              planner_options=options, progress=False))
        yield {"pool": pool, "dear": dear_pool, "data": d / "data"}


def _cached_before_prices_were_kept(cache_file) -> None:
    """Every entry of the response cache as versions before stop 43 wrote it: no price, no mode."""
    with sqlite3.connect(cache_file) as db:
        for key, value in db.execute("SELECT key, value FROM responses").fetchall():
            entry = {k: v for k, v in orjson.loads(value).items()
                     if k not in ("input_price", "output_price", "paid_mode")}
            db.execute("UPDATE responses SET value = ? WHERE key = ?", (orjson.dumps(entry), key))


def _train(logged, out, pool, *runs):
    return cli("policy", "train", "--pool", pool, "--runs", *runs, "--data-dir", logged["data"], "--out", out,
               "--learner", "table")


def _prices(logged, root):
    folder = artifact.find(load_pool(logged["pool"]), root)
    return orjson.loads((folder / "policy.json").read_bytes())["pool"]["prices"]


def test_a_run_served_from_the_cache_after_a_price_rise_records_the_price_first_paid(logged, tmp_path):
    r = _train(logged, tmp_path / "p", logged["dear"], "again")
    assert r.returncode == 0, r.stderr
    assert "warning: run again: weak: its" in r.stderr and CACHED in r.stderr
    assert "fast:" not in r.stderr  # its price did not change
    assert "weak: $1/$2 in run(s) again, $100/$200 in --pool" in r.stderr
    assert _prices(logged, tmp_path / "p")["weak"] == [pytest.approx(1e-6), pytest.approx(2e-6)]
    # The price-change safeguard holds: planning at the dear prices is told they changed.
    show = lambda pool: cli("policy", "show", "--pool", pool, "--policy", tmp_path / "p").stdout  # noqa: E731
    assert "weak: $1/$2 -> $100/$200" in show(logged["dear"])
    assert "PRICES CHANGED" not in show(logged["pool"])


def test_runs_whose_costs_were_paid_at_the_same_prices_do_not_disagree(logged, tmp_path):
    r = _train(logged, tmp_path / "p", logged["dear"], "first", "again")
    assert r.returncode == 0, r.stderr
    assert "run again $100/$200" not in r.stderr
    assert "weak: $1/$2 in run(s) first, again, $100/$200 in --pool" in r.stderr
    assert _prices(logged, tmp_path / "p")["weak"] == [pytest.approx(1e-6), pytest.approx(2e-6)]
    # Without a price change, a run served from the cache records its pool's prices exactly, quietly.
    _trained_quietly_at_pool_prices(logged, tmp_path / "q", "first", "same")


def _trained_quietly_at_pool_prices(runs: dict, out, *run_ids: str) -> None:
    """Training on `run_ids` under their own pool says nothing of prices and records the pool's."""
    r = _train(runs, out, runs["pool"], *run_ids)
    assert r.returncode == 0, r.stderr
    assert "response cache" not in r.stderr and "paid at other prices" not in r.stderr
    assert _prices(runs, out) == artifact.prices(load_pool(runs["pool"]))


def test_a_run_partly_served_from_the_cache_names_both_prices(logged, tmp_path):
    r = _train(logged, tmp_path / "p", logged["dear"], "more")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "warning: run more:" in x)
    assert CACHED in line and "were paid at it); the artifact takes $1/$2, the price most of them were paid at" in line
    # 20 of its 30 queries were answered before, at the old price: most of weak's costs are at it.
    assert _prices(logged, tmp_path / "p")["weak"] == [pytest.approx(1e-6), pytest.approx(2e-6)]


@pytest.fixture(scope="module")
def one_call(tmp_path_factory):
    """A pool of weak alone, at $1/$2 and (a copy) at $100/$200: run `w1` pays for one query's
    one call under the first, `w2` repeats it under the dear copy (its one call from the cache)."""
    from conductor.sim import start_sim

    d = tmp_path_factory.mktemp("prices42-one")
    queries = d / "queries.parquet"
    pq.write_table(pq.read_table(SAMPLE).slice(0, 1), queries)
    with start_sim(sim_server(d), [queries]) as sim:
        pool = write_pool(d / "w.yaml", sim.url, names=("weak",))
        dear = [worker("weak", sim.url)]
        dear[0]["price"] = {"input_per_mtok": 100.0, "output_per_mtok": 200.0}
        dear_pool = write_pool(d / "dear.yaml", sim.url, workers=dear)
        options = {"policy": "none", "candidates": "bandit", "explore": 1.0}
        for run_id, p in (("w1", pool), ("w2", dear_pool)):
            if run_id == "w2":
                _cached_before_prices_were_kept(d / "data" / "cache.sqlite")
            run_all(RunConfig(queries=queries, pool=p, data_dir=d / "data", run_id=run_id, samples=1,
                              planner_options=options, progress=False))
        yield {"pool": pool, "dear": dear_pool, "data": d / "data"}


def test_one_cache_served_call_after_a_price_rise_records_the_pool_price_scaled_to_its_cost(one_call, tmp_path):
    """One call gives one equation for two prices: not "several prices", and not the new price kept."""
    r = _train(one_call, tmp_path / "p", one_call["dear"], "w2")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "warning: run w2:" in x)
    assert "several prices" not in line
    assert ("at $1/$2 (1 call cannot tell an input from an output price, so this is the run's pool price scaled to "
            "their cost, exact if both prices moved by one factor), not the run's pool price $100/$200") in line
    assert _prices(one_call, tmp_path / "p")["weak"] == [pytest.approx(1e-6), pytest.approx(2e-6)]
    show = lambda pool: cli("policy", "show", "--pool", pool, "--policy", tmp_path / "p").stdout  # noqa: E731
    assert "weak: $1/$2 -> $100/$200" in show(one_call["dear"])
    assert "PRICES CHANGED" not in show(one_call["pool"])


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """Pool A and its dear copy with a `mode: batch` provider (batch price x 0.5), and A online.
    `b1` buys 20 queries through batch under A ($0.5/$1 paid); `b2` repeats them under the dear
    copy (all from the cache); `o2` adds 10 queries online under A ($1/$2 paid); `mix` repeats
    all 30 through batch under the dear copy: its cache-served costs are at both $0.5/$1 and $1/$2."""
    from conductor.sim import start_sim

    d = tmp_path_factory.mktemp("prices42-batch")
    table = pq.read_table(SAMPLE)
    queries, wider = d / "queries.parquet", d / "wider.parquet"
    pq.write_table(table.slice(0, 20), queries)
    pq.write_table(table.slice(0, 30), wider)
    batch = {"sim": {"max_concurrency": 32, "timeout_s": 10, "mode": "batch", "batch_poll_s": 0.2,
                     "batch_collect_s": 0.3}}
    with start_sim(sim_server(d), [wider]) as sim:
        online = write_pool(d / "a.yaml", sim.url)
        pool = write_pool(d / "batch.yaml", sim.url, providers=batch)
        dear = [worker(n, sim.url) for n in ("fast", "weak")]
        dear[1]["price"] = {"input_per_mtok": 100.0, "output_per_mtok": 200.0}
        dear_pool = write_pool(d / "dear.yaml", sim.url, providers=batch, workers=dear)
        options = {"policy": "none", "candidates": "bandit", "explore": 1.0}
        for run_id, q, p in (("b1", queries, pool), ("b2", queries, dear_pool), ("o2", wider, online),
                             ("mix", wider, dear_pool)):
            if run_id in ("b2", "mix"):
                _cached_before_prices_were_kept(d / "data" / "cache.sqlite")
            run_all(RunConfig(queries=q, pool=p, data_dir=d / "data", run_id=run_id, samples=4,
                              planner_options=options, progress=False))
        yield {"pool": pool, "online": online, "dear": dear_pool, "data": d / "data"}


def test_answers_first_bought_through_batch_record_the_list_price_as_fresh_batch_calls_do(batched, tmp_path):
    r = _train(batched, tmp_path / "p", batched["dear"], "b2")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "warning: run b2:" in x)
    assert ("at $1/$2 (all at its batch price $0.5/$1, taken as batch calls: provider sim has mode: batch), not the "
            "run's pool price $100/$200; the artifact takes $1/$2") in line
    assert _prices(batched, tmp_path / "p")["weak"] == [pytest.approx(1e-6), pytest.approx(2e-6)]
    # Planning under the price the answers were bought at (batch or online) is told of no change.
    for pool in (batched["pool"], batched["online"]):
        assert "PRICES CHANGED" not in cli("policy", "show", "--pool", pool, "--policy", tmp_path / "p").stdout
    # A run that bought them through batch at the pool price records the same list price, quietly.
    r = _train(batched, tmp_path / "q", batched["pool"], "b1", "b2")
    assert r.returncode == 0, r.stderr
    assert "paid at other prices" not in r.stderr, r.stderr
    _trained_quietly_at_pool_prices(batched, tmp_path / "s", "b1", "o2")


def test_cache_served_answers_bought_online_and_through_batch_at_one_old_price_read_as_that_price(batched, tmp_path):
    r = _train(batched, tmp_path / "p", batched["dear"], "mix")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "warning: run mix:" in x)
    assert "several prices" not in line
    assert "weak: its" in line and " at its batch price $0.5/$1), not the run's pool price $100/$200" in line
    assert _prices(batched, tmp_path / "p")["weak"] == [pytest.approx(1e-6), pytest.approx(2e-6)]
