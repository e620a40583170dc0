"""The price a cached answer was paid at, kept with it (stop 43): a cache entry holds the price
(USD per token, the list price) and mode (online or batch) of its call, every trace row of an
answer carries them (input_price, output_price, paid_mode), and `policy train` takes them instead
of reading the price back from costs, which two calls of different token mixes paid at two
prices always "solve" to some third price. Entries written before (no such fields) are still
served, and read back as before.

Small simulated pools of one worker; runs of one to three queries."""

from __future__ import annotations

import shutil
import sqlite3
from contextlib import closing

import orjson
import pyarrow.parquet as pq
import pytest

from conductor.execute.cache import Cache, Entry, read_entry
from conductor.policy import artifact
from conductor.pool import load_pool
from conductor.runner import RunConfig, run_all
from tests.conftest import SAMPLE, cli, worker, write_pool
from tests.test_policy_inputs import sim_server

OPTIONS = {"policy": "none", "candidates": "bandit", "explore": 1.0}
A, B, DEAR = (1.0, 2.0), (1.1, 2.0), (100.0, 200.0)  # USD per million input/output tokens
PRICE_FIELDS = ("input_price", "output_price", "paid_mode")


def _weak(url: str, price: tuple[float, float], **params) -> list[dict]:
    w = worker("weak", url)
    w["price"] = {"input_per_mtok": price[0], "output_per_mtok": price[1]}
    w["params"] = {**w["params"], **params}
    return [w]


def _run(queries, pool, data, run_id, **extra):
    return run_all(RunConfig(queries=queries, pool=pool, data_dir=data, run_id=run_id, samples=1,
                             planner_options=OPTIONS, progress=False, **extra))


def _traces(data, run_id) -> list[dict]:
    return pq.read_table(data / "runs" / run_id / "traces.parquet").to_pylist()


def _train(runs: dict, out, pool, *run_ids: str):
    return cli("policy", "train", "--pool", pool, "--runs", *run_ids, "--data-dir", runs["data"], "--out", out,
               "--learner", "table")


def _prices(runs: dict, root) -> dict:
    folder = artifact.find(load_pool(runs["pool"]), root)
    return orjson.loads((folder / "policy.json").read_bytes())["pool"]["prices"]


def _per_token(price: tuple[float, float]) -> list:
    return [pytest.approx(price[0] / 1e6, rel=1e-12), pytest.approx(price[1] / 1e6, rel=1e-12)]


def _strip(cache_file, keys) -> None:
    """Rewrite the entries of `keys` as versions before stop 43 wrote them: no price fields."""
    with sqlite3.connect(cache_file) as db:
        for key in keys:
            value = orjson.loads(db.execute("SELECT value FROM responses WHERE key = ?", (key,)).fetchone()[0])
            for f in PRICE_FIELDS:
                value.pop(f, None)
            db.execute("UPDATE responses SET value = ? WHERE key = ?", (orjson.dumps(value), key))


@pytest.fixture(scope="module")
def two_prices(tmp_path_factory):
    """Worker weak alone. `pa` pays for query 0 at $1/$2, `pb` for query 1 at $1.1/$2; `both` asks
    both after a rise to $100/$200 (both answers from the cache: two token mixes, two prices).
    Then, in a second data folder holding the same cache with query 0's entry rewritten as older
    versions wrote it (no price), `mixed` asks both again under $100/$200."""
    from conductor.sim import start_sim

    d = tmp_path_factory.mktemp("prices43")
    table = pq.read_table(SAMPLE)
    q0, q1, both = d / "q0.parquet", d / "q1.parquet", d / "both.parquet"
    pq.write_table(table.slice(0, 1), q0)
    pq.write_table(table.slice(1, 1), q1)
    pq.write_table(table.slice(0, 2), both)
    with start_sim(sim_server(d), [both]) as sim:
        pool_a = write_pool(d / "a.yaml", sim.url, workers=_weak(sim.url, A))
        pool_b = write_pool(d / "b.yaml", sim.url, workers=_weak(sim.url, B))
        dear = write_pool(d / "dear.yaml", sim.url, workers=_weak(sim.url, DEAR))
        data = d / "data"
        _run(q0, pool_a, data, "pa")
        _run(q1, pool_b, data, "pb")
        _run(both, dear, data, "both")
        old = d / "old"
        old.mkdir()
        shutil.copy(data / "cache.sqlite", old / "cache.sqlite")
        _strip(old / "cache.sqlite", [_traces(data, "pa")[0]["request_key"]])
        summary = _run(both, dear, old, "mixed")
        yield {"pool": pool_a, "dear": dear, "data": data, "old": old, "mixed": summary}


def test_every_answer_row_says_the_price_it_was_paid_at_paid_or_served(two_prices):
    data = two_prices["data"]
    (pa,), (pb,) = _traces(data, "pa"), _traces(data, "pb")
    for row, price in ((pa, A), (pb, B)):
        assert not row["cache_hit"] and row["attempts"] == 1
        assert [row["input_price"], row["output_price"]] == _per_token(price) and row["paid_mode"] == "online"
        assert row["cost_usd"] == pytest.approx(row["prompt_tokens"] * price[0] / 1e6
                                                + row["completion_tokens"] * price[1] / 1e6, rel=1e-12)
    served = {r["query_id"]: r for r in _traces(data, "both")}
    assert len(served) == 2 and all(r["cache_hit"] and r["cost_usd"] == 0 for r in served.values())
    for first, price in ((pa, A), (pb, B)):  # each at its own first price, not the run's, nor the other's
        row = served[first["query_id"]]
        assert [row["input_price"], row["output_price"]] == _per_token(price) and row["paid_mode"] == "online"
        assert row["original_cost_usd"] == pytest.approx(first["cost_usd"], rel=1e-12)


def test_two_cached_answers_paid_at_two_prices_are_told_apart(two_prices, tmp_path):
    """Read back, two calls of different token mixes solve to one price that neither was paid at
    (here $1.63/$1.04); recorded, both prices are said and the artifact takes one of them."""
    runs = two_prices
    mixes = {(r["prompt_tokens"], r["completion_tokens"]) for r in _traces(runs["data"], "both")}
    assert len(mixes) == 2 and len({pt / ct for pt, ct in mixes}) == 2  # two token mixes
    r = _train(runs, tmp_path / "p", runs["dear"], "both")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "warning: run both:" in x)
    assert ("weak: its 2 paid calls were all served from the response cache at the cost first paid, at several "
            "prices: $1/$2 (1 call), $1.1/$2 (1 call), not the run's pool price $100/$200; the artifact takes "
            "$1.1/$2, the price most of them were paid at (of those tied, the one of most cost)") in line
    assert _prices(runs, tmp_path / "p")["weak"] == _per_token(B)
    assert "weak: $1.1/$2 in run(s) both, $100/$200 in --pool" in r.stderr


def test_an_entry_cached_before_prices_were_kept_is_served_and_read_back_with_its_notes(two_prices, tmp_path):
    runs = two_prices
    assert runs["mixed"]["calls"] == 0 and runs["mixed"]["cache_hits"] == 2  # nothing paid again
    with closing(Cache(runs["old"] / "cache.sqlite")) as c:  # the entry is as older versions wrote it
        key = _traces(runs["data"], "pa")[0]["request_key"]
        entry = c.get(key)
        assert entry is not None and entry.input_price is None and entry.paid_mode is None
    rows = {r["query_id"]: r for r in _traces(runs["old"], "mixed")}
    pa, pb = _traces(runs["data"], "pa")[0], _traces(runs["data"], "pb")[0]
    old, new = rows[pa["query_id"]], rows[pb["query_id"]]
    assert old["cache_hit"] and old["response_text"] == pa["response_text"]
    assert [old[f] for f in PRICE_FIELDS] == [None, None, None]
    assert old["original_cost_usd"] == pytest.approx(pa["cost_usd"], rel=1e-12)
    assert [new["input_price"], new["output_price"]] == _per_token(B) and new["paid_mode"] == "online"
    # Training takes the recorded price where there is one, and reads back (with its notes) where not.
    r = cli("policy", "train", "--pool", runs["dear"], "--runs", "mixed", "--data-dir", runs["old"],
            "--out", tmp_path / "p", "--learner", "table")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if "warning: run mixed:" in x)
    assert ("at several prices: $1.1/$2 (1 call), $1/$2 (1 call; 1 call cannot tell an input from an output price, "
            "so this is the run's pool price scaled to their cost, exact if both prices moved by one factor), not "
            "the run's pool price $100/$200") in line



def test_runs_from_before_the_columns_still_load_train_and_export(two_prices, tmp_path):
    """A run whose traces.parquet lacks the columns (written before them) reads in the catalog beside
    newer runs (null there), trains (its prices read back) and exports; a resumed run whose journal
    has lines without them writes the columns, null on those lines."""
    from conductor.schemas import TRACES
    from conductor.store import RunDir, finalize_journal

    data = tmp_path / "data"
    shutil.copytree(two_prices["data"], data)
    for run_id in ("pa", "both"):
        path = data / "runs" / run_id / "traces.parquet"
        table = pq.read_table(path)
        pq.write_table(table.drop_columns(list(PRICE_FIELDS)), path)
    r = cli("sql", "SELECT run_id, input_price, output_price, paid_mode FROM traces ORDER BY run_id",
            "--data-dir", data, "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = [orjson.loads(line) for line in r.stdout.splitlines()]  # JSON Lines
    assert [(x["run_id"], x["paid_mode"]) for x in rows] == [("both", None), ("both", None), ("pa", None),
                                                             ("pb", "online")]
    assert rows[3]["input_price"] == pytest.approx(B[0] / 1e6) and rows[0]["input_price"] is None
    r = _train({**two_prices, "data": data}, tmp_path / "p", two_prices["dear"], "both")
    assert r.returncode == 0, r.stderr
    assert "warning: run both: weak: its 2 paid calls were all served from the response cache" in r.stderr
    r = cli("export", "--run", "both", "--data-dir", data, "--format", "trl", "--out", tmp_path / "x")
    assert r.returncode == 0, r.stderr
    # A run resumed from a journal written before the columns: its lines lack them.
    run = RunDir(data, "both")
    steps = run.work / "steps.jsonl"
    lines = [orjson.loads(x) for x in steps.read_bytes().splitlines()]
    assert lines and all(set(PRICE_FIELDS) <= set(x) for x in lines)
    steps.write_bytes(b"".join(orjson.dumps({k: v for k, v in x.items() if k not in PRICE_FIELDS}) + b"\n"
                               for x in lines))
    finalize_journal(run)
    table = pq.read_table(run.table("traces"))
    assert table.schema.equals(TRACES)
    assert all(table.column(f).null_count == table.num_rows for f in PRICE_FIELDS)


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """Worker weak on a `mode: batch` provider (batch price x 0.5): `b1` buys one query through
    batch at $1/$2 (paid $0.5/$1); `b2` asks it again at $100/$200 (from the cache)."""
    from conductor.sim import start_sim

    d = tmp_path_factory.mktemp("prices43-batch")
    queries = d / "q.parquet"
    pq.write_table(pq.read_table(SAMPLE).slice(0, 1), queries)
    batch = {"sim": {"max_concurrency": 32, "timeout_s": 10, "mode": "batch", "batch_poll_s": 0.2,
                     "batch_collect_s": 0.3}}
    with start_sim(sim_server(d), [queries]) as sim:
        pool = write_pool(d / "a.yaml", sim.url, providers=batch, workers=_weak(sim.url, A))
        dear = write_pool(d / "dear.yaml", sim.url, providers=batch, workers=_weak(sim.url, DEAR))
        for run_id, p in (("b1", pool), ("b2", dear)):
            _run(queries, p, d / "data", run_id)
        yield {"pool": pool, "dear": dear, "data": d / "data"}


def test_an_answer_bought_through_batch_says_so_with_its_list_price(batched, tmp_path):
    (paid,), (served,) = _traces(batched["data"], "b1"), _traces(batched["data"], "b2")
    assert not paid["cache_hit"] and served["cache_hit"]
    for row in (paid, served):
        assert [row["input_price"], row["output_price"]] == _per_token(A) and row["paid_mode"] == "batch"
    listed = paid["prompt_tokens"] * A[0] / 1e6 + paid["completion_tokens"] * A[1] / 1e6
    assert paid["cost_usd"] == pytest.approx(listed * 0.5, rel=1e-12)
    assert served["original_cost_usd"] == pytest.approx(listed * 0.5, rel=1e-12)
    r = _train(batched, tmp_path / "p", batched["dear"], "b2")
    assert r.returncode == 0, r.stderr
    assert ("weak: its 1 paid calls were all served from the response cache at the cost first paid, at $1/$2 "
            "(bought through batch: all at its batch price $0.5/$1), not the run's pool price $100/$200; the "
            "artifact takes $1/$2") in r.stderr
    assert _prices(batched, tmp_path / "p")["weak"] == _per_token(A)
    # Under the price it was bought at, the runs' costs agree with --pool's.
    r = _train(batched, tmp_path / "q", batched["pool"], "b1", "b2")
    assert r.returncode == 0 and "paid at other prices" not in r.stderr, r.stderr
    assert "warning: run b1" not in r.stderr


def test_entries_read_back_old_new_and_newer():
    full = Entry("a", 3, 4, False, True, 1e-5, 0.1, None, 1, 1e-6, 2e-6, "online")
    got = read_entry(orjson.dumps(full.__dict__))
    assert got == full and got.__dict__.keys() == full.__dict__.keys()
    older = {"text": "old", "prompt_tokens": 1, "completion_tokens": 1, "usage_estimated": False,
             "simulated": False, "cost_usd": 3e-6, "latency_s": 0.1, "logprob": None, "attempts": 1}
    got = read_entry(orjson.dumps(older))
    assert (got.input_price, got.output_price, got.paid_mode) == (None, None, None) and got.cost_usd == 3e-6
    # a field a later version may add is dropped, not a TypeError that ends the run
    got = read_entry(orjson.dumps({**full.__dict__, "later_field": 1}))
    assert got == full


def test_a_price_read_back_and_the_same_price_recorded_count_as_one(tmp_path, capsys):
    """Across the upgrade a worker's answers are half recorded at $1/$2, half cached before prices
    were kept and read back to $1/$2: one price, 4 of 7 calls, which the artifact takes; counted
    apart (2 and 2), the pool's 3 fresh calls at $100/$200 won (review43b 4)."""
    import pyarrow as pa
    import yaml

    from conductor.policy.traininputs import served_prices

    (tmp_path / "pool.yaml").write_text(yaml.safe_dump({"providers": {"sim": {}}, "workers": [
        {"id": "weak", "model": "openai/weak", "provider": "sim", "api_base": "http://127.0.0.1:9/v1",
         "description": "w", "price": {"input_per_mtok": 100.0, "output_per_mtok": 200.0}}]}))
    old, dear = (1e-6, 2e-6), (1e-4, 2e-4)

    def row(hit, pt, ct, price, recorded):
        cost = pt * price[0] + ct * price[1]
        return {"worker": "weak", "cache_hit": hit, "prompt_tokens": pt, "completion_tokens": ct, "status": "ok",
                "original_cost_usd": cost, "cost_usd": 0.0 if hit else cost,
                "input_price": price[0] if recorded else None, "output_price": price[1] if recorded else None,
                "paid_mode": "online" if recorded else None}

    rows = [row(True, 50, 10, old, True), row(True, 70, 30, old, True),
            row(True, 40, 5, old, False), row(True, 20, 40, old, False),
            row(False, 30, 3, dear, True), row(False, 31, 3, dear, True), row(False, 32, 3, dear, True)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "traces.parquet")
    out = served_prices("r", {"weak": list(dear)}, load_pool(tmp_path / "pool.yaml"), tmp_path / "traces.parquet")
    assert [round(x * 1e6, 9) for x in out["weak"]] == [1.0, 2.0]
    assert "4 of its 7 paid calls" in capsys.readouterr().err
