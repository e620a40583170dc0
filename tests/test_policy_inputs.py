"""What `conductor policy` says about its inputs (audit 30): the fixed action `show` names, a
pool whose prices moved since training, an artifact or run of another pool, a lambda too
large, a rerun whose --policy now names a newer version. One small run over the simulated
pool, trained in a fraction of a second."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.planners.base import Query
from conductor.planners.embedded import EmbeddedConfig, EmbeddedPlanner
from conductor.policy import artifact
from conductor.pool import load_pool
from conductor.runner import RunConfig, run_all
from tests.conftest import SAMPLE, cli, worker, write_pool


def sim_server(d: Path) -> Path:
    """The simulated server's workers: fast (skill 0.9) and weak (0.3), answering in 2 ms."""
    server = d / "server.yaml"
    server.write_text(yaml.safe_dump({"workers": [
        {"id": n, "model": f"openai/{n}", "simulate": {"skill": s, "latency_ms": {"mean": 2, "sd": 0}}}
        for n, s in (("fast", 0.9), ("weak", 0.3))]}))
    return server


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Pool A (fast, weak), a run of 20 queries x 4 uniform plans over it, and pool B (A plus
    a worker: another pool key). The server stays up for the module's rollouts."""
    from conductor.sim import start_sim

    d = tmp_path_factory.mktemp("policy-inputs")
    queries = d / "queries.parquet"
    pq.write_table(pq.read_table(SAMPLE).slice(0, 20), queries)
    with start_sim(sim_server(d), [queries]) as sim:
        pool = write_pool(d / "a.yaml", sim.url)
        other = write_pool(d / "b.yaml", sim.url, workers=[worker(n, sim.url) for n in ("fast", "weak", "extra")])
        run_all(RunConfig(queries=queries, pool=pool, data_dir=d / "data", run_id="explore", samples=4,
                          planner_options={"policy": "none", "candidates": "bandit", "explore": 1.0},
                          progress=False))
        yield {"dir": d, "pool": pool, "other": other, "queries": queries, "data": d / "data", "url": sim.url}


def _train(logged, out, *extra, pool=None):
    r = cli("policy", "train", "--pool", pool or logged["pool"], "--runs", "explore", "--data-dir", logged["data"],
            "--out", out, "--learner", "table", *extra)
    return r


def _meta(folder):
    return orjson.loads((folder / "policy.json").read_bytes())


def test_show_names_the_fixed_action_planning_uses_not_the_held_back_fit(logged, tmp_path):
    """The selection's fixed action is fitted without the held-back queries and may differ from
    the one saved (fitted on every query), which is the one planning uses when it ships."""
    assert _train(logged, tmp_path / "p").returncode == 0
    folder = artifact.find(load_pool(logged["pool"]), tmp_path / "p")
    meta = _meta(folder)
    meta["shipped"] = "fixed"
    sel = meta["training"]["selection"]
    sel["fixed"]["choice"] = {t: "single:weak" for t in sel["fixed"]["choice"]}  # the held-back fit's pick
    (folder / "policy.json").write_bytes(orjson.dumps(meta))
    shipped = meta["fixed"]["choice"]
    assert shipped["math"] != "single:weak"

    r = cli("policy", "show", "--pool", logged["pool"], "--policy", folder)
    assert r.returncode == 0, r.stderr
    assert f"math: {shipped['math']}" in r.stdout.split("\nfixed    ")[1]
    assert "(fitted on every train query; planning uses it)" in r.stdout
    assert "as fitted without them: " in r.stdout and "math: single:weak" in r.stdout
    # ... and it is what planning plays.
    draft = EmbeddedPlanner(EmbeddedConfig(policy=str(folder))).plan(
        [Query("q", "What is 2 + 2?", "math")], load_pool(logged["pool"]), 1)[0][0]
    assert draft.info["action"] == shipped["math"]


def test_a_price_change_since_training_is_said_where_the_artifact_is_used(logged, tmp_path, capsys):
    assert _train(logged, tmp_path / "p").returncode == 0
    folder = artifact.find(load_pool(logged["pool"]), tmp_path / "p")
    assert _meta(folder)["pool"]["prices"]["weak"] == [pytest.approx(1e-6), pytest.approx(2e-6)]
    dear = yaml.safe_load(logged["pool"].read_text())
    for w in dear["workers"]:
        if w["id"] == "weak":
            w["price"] = {"input_per_mtok": 100.0, "output_per_mtok": 200.0}
    (tmp_path / "dear.yaml").write_text(yaml.safe_dump(dear))
    dear_pool = tmp_path / "dear.yaml"

    r = cli("policy", "show", "--pool", dear_pool, "--policy", tmp_path / "p")
    assert r.returncode == 0 and "PRICES CHANGED since training" in r.stdout and "weak: $1/$2 -> $100/$200" in r.stdout
    assert "PRICES CHANGED" not in cli("policy", "show", "--pool", logged["pool"], "--policy", tmp_path / "p").stdout

    # Planning with it warns on stderr and records it in each plan's policy label.
    r = cli("policy", "rollouts", logged["queries"], "--pool", dear_pool, "-k", "2", "--policy", tmp_path / "p",
            "--run-id", "dear", "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 0, r.stderr
    assert f"warning: policy {folder} was trained under other prices" in r.stderr
    assert "weak: $1/$2 -> $100/$200" in r.stderr and r.stderr.count("trained under other prices") == 1
    plans = pq.read_table(tmp_path / "data" / "runs" / "dear" / "plans.parquet").to_pylist()
    labels = {orjson.loads(p["info_json"]).get("policy") for p in plans if p["valid"]}
    assert labels and all(label.endswith("(trained under other prices)") for label in labels if label != "prior")

    # An artifact written before prices were recorded still loads, without a word.
    meta = _meta(folder)
    del meta["pool"]["prices"]
    (folder / "policy.json").write_bytes(orjson.dumps(meta))
    capsys.readouterr()
    loaded = artifact.load(folder, load_pool(dear_pool))
    assert "warning" not in capsys.readouterr().err and not loaded.label.endswith("prices)")


def test_a_lambda_too_large_for_the_arithmetic_is_refused_by_name(logged, tmp_path):
    r = _train(logged, tmp_path / "p", "--lambda", "1e308")
    assert r.returncode == 2 and "--lambda must be a number from 0 to 1e+09 (got 1e+308)" in r.stderr
    assert _train(logged, tmp_path / "p", "--lambda", "1e9").returncode == 0


def test_a_rerun_whose_policy_folder_gained_a_version_names_both_versions(logged, tmp_path):
    assert _train(logged, tmp_path / "p").returncode == 0
    args = ["policy", "rollouts", logged["queries"], "--pool", logged["pool"], "-k", "2", "--policy", tmp_path / "p",
            "--run-id", "r1", "--data-dir", tmp_path / "data", "--quiet"]
    assert cli(*args).returncode == 0
    assert _train(logged, tmp_path / "p").returncode == 0  # v0002 appears
    r = cli(*args)
    first = artifact.find(load_pool(logged["pool"]), tmp_path / "p").parent / "v0001"
    assert r.returncode == 2 and "other inputs or settings" not in r.stderr
    assert f"run r1 was planned with the policy v0001 ({first})" in r.stderr
    assert f"--policy {tmp_path / 'p'} now resolves to v0002" in r.stderr and f"pass --policy {first}" in r.stderr


def test_an_artifact_of_another_pool_is_named_against_the_users_pool(logged, tmp_path):
    assert _train(logged, tmp_path / "p").returncode == 0
    folder = artifact.find(load_pool(logged["pool"]), tmp_path / "p")
    keys = [artifact.pool_key(load_pool(p)) for p in (logged["pool"], logged["other"])]
    r = cli("policy", "show", "--pool", logged["other"], "--policy", folder)
    assert r.returncode == 0 and "NOT FOR THIS POOL" in r.stdout and all(k in r.stdout for k in keys)
    assert "NOT FOR THIS POOL" not in cli("policy", "show", "--pool", logged["pool"], "--policy", folder).stdout
    r = cli("policy", "eval", "--pool", logged["other"], "--queries", logged["queries"], "--policies", folder,
            "--out", tmp_path / "eval")
    assert r.returncode == 2 and f"was trained for pool {keys[0]}" in r.stderr
    assert f"not this pool ({keys[1]}, {logged['other']})" in r.stderr


def test_training_on_a_run_of_another_pool_is_refused_unless_asked(logged, tmp_path):
    keys = [artifact.pool_key(load_pool(p)) for p in (logged["pool"], logged["other"])]
    r = _train(logged, tmp_path / "p", pool=logged["other"])
    assert r.returncode == 2 and not (tmp_path / "p").exists()
    assert f"run explore was made with pool {logged['pool']} (pool key {keys[0]}" in r.stderr
    assert f"not --pool {logged['other']} (pool key {keys[1]}" in r.stderr and "--allow-other-pool" in r.stderr
    r = _train(logged, tmp_path / "p", "--allow-other-pool", pool=logged["other"])
    assert r.returncode == 0 and "warning: run explore was made with pool" in r.stderr
    folder = artifact.find(load_pool(logged["other"]), tmp_path / "p")
    assert _meta(folder)["training"]["runs"][0]["pool_key"] == keys[0]
