"""The prices `policy train` records for a run served from the response cache after a price
change (audit69 F5): a cache hit logs the cost first paid for its answer, so the artifact must
record the price that cost was paid at, not the run's new pool price. One small simulated pool;
runs of 20 and 30 queries, trained in a fraction of a second."""

from __future__ import annotations

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
    r = _train(logged, tmp_path / "q", logged["pool"], "first", "same")
    assert r.returncode == 0, r.stderr
    assert "response cache" not in r.stderr and "paid at other prices" not in r.stderr
    assert _prices(logged, tmp_path / "q") == artifact.prices(load_pool(logged["pool"]))


def test_a_run_partly_served_from_the_cache_names_both_prices(logged, tmp_path):
    r = _train(logged, tmp_path / "p", logged["dear"], "more")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "warning: run more:" in x)
    assert CACHED in line and "were paid at it); the artifact takes $1/$2, the price most of them were paid at" in line
    # 20 of its 30 queries were answered before, at the old price: most of weak's costs are at it.
    assert _prices(logged, tmp_path / "p")["weak"] == [pytest.approx(1e-6), pytest.approx(2e-6)]
