"""Review 40b on training's figures: an action's row in `training.measured` says what its `n` is made
of (logged + unservable; its unlogged queries count at its logged mean) (item 9); a sweep with a few
ungraded plans is not called "not a sweep" (item 10); the evaluation's best fixed cascade is chosen
on the guarded figures training chooses on, not on a lucky cascade's few queries; the Dagster
`policy` asset shows the training's coverage.

A made-up recorded table of 24 questions and four workers (`tiny` has no recorded answer to the
last 4), served by `conductor replay serve`."""

from __future__ import annotations

import json
import math
import shutil

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from conductor.policy import artifact
from conductor.policy.actions import action_set
from conductor.pool import load_pool
from conductor.runner import RunConfig, planning_pool, run_all
from tests.conftest import cli
from tests.replayserve import served_table
from tests.test_policy_coverage_stop40 import _rows as coverage_rows

pytestmark = pytest.mark.slow  # rollouts over a replay server

N, UNRECORDED = 24, 4  # tiny: no recorded answer to the last 4 questions, so no action with it serves them
WORKERS = {"big": (set(range(N)) - {5, 17}, 0.01),
           "mid": ({q for q in range(N) if q % 4 != 3}, 0.002),
           "small": ({q for q in range(N) if q % 2 == 0 or q % 9 == 1}, 0.0006),
           "tiny": ({q for q in range(N) if q % 2 == 1}, 0.0001)}
STEADY, LUCKY = "cascade:small+tiny>big", "cascade:small+tiny>mid"


def _rows() -> list[dict]:
    return coverage_rows(N, WORKERS, {"tiny": UNRECORDED})


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """Runs over the table: a sweep of all 24 queries, a sweep of the first 8, `single:big` on every
    query, the steady cascade on every query, and the lucky cascade on q00 and q01 (right on both)."""
    d = tmp_path_factory.mktemp("stop41")
    with served_table(d, _rows(), "stop41_logs") as served, pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONDUCTOR_REPLAY_URL", served["server"].url)
        pool, data, queries = served["pool"], d / "data", served["queries"]
        table = pq.read_table(queries)
        first, two = d / "first8.parquet", d / "two.parquet"
        pq.write_table(table.slice(0, 8), first)
        pq.write_table(table.filter(pc.is_in(table.column("query_id"), pa.array(["q00", "q01"]))), two)
        k = len(action_set(planning_pool(load_pool(pool)), "math"))
        assert {STEADY, LUCKY} <= {a.key for a in action_set(planning_pool(load_pool(pool)), "math")}

        def run(run_id, queries, samples, **options):
            run_all(RunConfig(queries=queries, pool=pool, data_dir=data, run_id=run_id, samples=samples,
                              planner_options=options, seed=7, progress=False))

        run("sweep", queries, k, sweep=True, policy="none")
        run("part", first, k, sweep=True, policy="none")
        run("big", queries, 1, policy="none", action="single:big")
        run("steady", queries, 1, policy="none", action=STEADY)
        run("lucky", two, 1, policy="none", action=LUCKY)
        yield {"dir": d, "pool": pool, "data": data, "queries": queries, "first": first}


def _train(logs, name, *runs, data=None):
    out = logs["dir"] / name
    r = cli("policy", "train", "--pool", logs["pool"], "--runs", *runs, "--data-dir", data or logs["data"],
            "--out", out, "--learner", "fixed", "--lambda", "0")
    assert r.returncode == 0, r.stderr
    folder = artifact.find(load_pool(logs["pool"]), out)
    meta = orjson.loads((folder / "policy.json").read_bytes())
    return r, folder, meta, {m["action"]: m for m in meta["training"]["measured"]["math"]}


def test_a_row_says_what_its_n_is_made_of_and_counts_its_unlogged_queries_at_its_logged_mean(logs):
    _, _, meta, rows = _train(logs, "pol-rows", "part", "big")
    tiny = rows["single:tiny"]
    # Logged on the 8 swept queries (right on the odd ones), no candidate on the last 4, a candidate
    # but never drawn on the other 12.
    first = pq.read_table(logs["first"]).column("query_id").to_pylist()
    logged_mean = sum(int(q[1:]) % 2 for q in first) / len(first)
    assert (tiny["logged"], tiny["unservable"], tiny["unlogged"]) == (8, UNRECORDED, N - 8 - UNRECORDED)
    assert tiny["n"] == tiny["logged"] + tiny["unservable"]  # the queries its figures rest on ...
    assert tiny["n"] + tiny["unlogged"] == meta["training"]["queries"] == N  # ... of the task's queries
    # The accuracy is per query of the task: the unlogged queries at the logged mean, the unservable at 0.
    assert tiny["accuracy"] == pytest.approx(logged_mean * (N - UNRECORDED) / N, abs=1e-5)
    p = tiny["accuracy"]
    assert tiny["se"] == pytest.approx(math.sqrt(p * (1 - p) / tiny["n"]), abs=1e-5)


def test_a_sweep_with_a_few_ungraded_plans_is_not_called_a_run_that_is_not_a_sweep(logs, tmp_path):
    """Two of the sweep's plans on one query went ungraded (as a budget stop leaves them)."""
    data = tmp_path / "data"
    shutil.copytree(logs["data"] / "runs" / "sweep", data / "runs" / "sweep")
    path = data / "runs" / "sweep" / "rewards.parquet"
    rewards = pq.read_table(path)
    plans = pq.read_table(data / "runs" / "sweep" / "plans.parquet").to_pylist()
    gone = [p["plan_id"] for p in plans if p["query_id"] == "q03" and p["valid"]][:2]
    ungraded = pc.is_in(rewards.column("plan_id"), pa.array(gone))
    for name in ("correct", "reward"):
        i = rewards.schema.get_field_index(name)
        rewards = rewards.set_column(i, name, pc.if_else(ungraded, pa.scalar(None, rewards.column(name).type),
                                                         rewards.column(name)))
    pq.write_table(rewards, path)
    r, folder, meta, _ = _train(logs, "pol-gaps", "sweep", data=data)
    c = meta["training"]["coverage"]["math"]
    assert c["pairs"] - c["pairs_logged"] == 2
    assert "not graded" in " ".join(meta["training"]["skipped"])
    assert "the runs are not a sweep" not in r.stderr
    assert (f"math: 2 of the {c['pairs']} (action, query) pairs the pool can serve on these {N} queries have no "
            f"usable log") in r.stderr
    assert "invalid or ungraded" in r.stderr and "or runs that are not a sweep" in r.stderr
    show = cli("policy", "show", "--pool", logs["pool"], "--policy", folder)
    assert show.returncode == 0, show.stderr
    assert f"coverage math: 2 of the {c['pairs']} (action, query) pairs the pool can serve have no usable log" \
        in show.stdout and "math: not a sweep" not in show.stdout


def test_the_best_fixed_cascade_is_chosen_on_the_guarded_figures_not_on_two_lucky_queries(logs, tmp_path):
    from conductor.evaluation import EvalConfig, evaluate

    _, folder, _, rows = _train(logs, "pol-cascade", "steady", "lucky", "big")
    steady, lucky = rows[STEADY], rows[LUCKY]
    # As logged, the lucky cascade (2 of 2 right) looks more accurate than the steady one; guarded, less.
    assert lucky["logged"] == 2 and lucky["accuracy"] > steady["accuracy"]
    assert "guarded_accuracy" not in steady and lucky["guarded_accuracy"] < steady["accuracy"]
    rep = evaluate(EvalConfig(pool=logs["pool"], queries=logs["queries"], split="all", out=tmp_path / "ev",
                              planner=False, policies=[folder]))
    [cascade] = [p for p in json.loads(rep.json_path.read_text())["policies"] if p["kind"] == "fixed_cascade"]
    assert cascade["info"]["choice"] == {"math": STEADY}
    assert f"best fixed cascade on train: {STEADY}" in rep.report_path.read_text()


def test_the_dagster_policy_asset_shows_the_trainings_coverage(logs, tmp_path):
    from dagster import materialize

    from assets.policy import policy
    from assets.resources import PoolResource, StorageResource

    def coverage(name, runs):
        result = materialize([policy], resources={"pool": PoolResource(path=str(logs["pool"])),
                                                  "storage": StorageResource(data_dir=str(logs["data"]))},
                             run_config={"ops": {"policy": {"config": {"runs": runs, "learner": "fixed",
                                                                       "out": str(tmp_path / name)}}}})
        assert result.success
        md = result.get_asset_materialization_events()[0].materialization.metadata
        meta = orjson.loads((artifact.find(load_pool(logs["pool"]), tmp_path / name) / "policy.json").read_bytes())
        return md["coverage"].value, meta["training"].get("coverage")

    said, recorded = coverage("partial", ["part", "big"])
    c = recorded["math"]
    assert said.startswith(f"math: {c['pairs'] - c['pairs_logged']} of the {c['pairs']} (action, query) pairs "
                           f"the pool can serve have no usable log")
    assert f"{c['actions_logged']} of {c['actions']} candidate actions logged" in said
    said, recorded = coverage("sweep", ["sweep"])
    assert recorded is None and said.startswith("complete: every (action, query) pair the pool can serve is logged")
