"""Audit 55: embedded planner options that planning alone refused (`action=` naming a worker the pool
lacks, a sweep short of samples) left a run folder behind in status `planning`; they are refused
before it is written. And what rewards' `cost_usd` holds for a plan served from the cache."""

from __future__ import annotations

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from conductor import runner, schemas
from conductor.cli import main as cli_main
from conductor.errors import ConductorError
from conductor.planners.base import Query
from conductor.policy.actions import action_set
from conductor.pool import load_pool
from conductor.rewards import RewardScheme
from conductor.runner import RunConfig, run_all
from tests.conftest import REPLAY, cli, files_under, write_pool

# slow: the simulated server, and a replay pool over the shared tables
pytestmark = pytest.mark.slow


def _refused_before_any_run_folder(r, data, message: str) -> None:
    assert r.returncode == 2 and message in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert not (data / "runs").exists(), files_under(data)


@pytest.mark.parametrize("action", ["single:nobody", "{math: 'cascade:fast+weak>nobody'}"],
                         ids=["key", "per-task"])
def test_an_action_naming_a_worker_not_in_the_pool_is_refused_before_any_run_folder(fresh_sim, tmp_path,
                                                                                     sample_queries, action):
    """It was refused only by planning, leaving the run in status `planning` in the catalog."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet",
            "--planner-option", f"action={action}")
    _refused_before_any_run_folder(r, tmp_path / "data", "worker(s) nobody not in the pool")
    assert fresh_sim.log()["total"] == 0


def test_a_sweep_short_of_samples_is_refused_before_any_run_folder(fresh_sim, tmp_path, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet",
            "--planner-option", "sweep=true")
    _refused_before_any_run_folder(r, tmp_path / "data", "candidate actions but only 1 samples; a sweep needs")
    assert fresh_sim.log()["total"] == 0


@pytest.mark.skipif(not REPLAY.is_dir(), reason=f"shared replay data not found at {REPLAY}")
def test_a_replay_sweep_is_refused_up_front_exactly_when_planning_would_refuse_it(tmp_path):
    """On a replay pool a query's candidates are those its recorded workers can serve: the up-front
    check must not ask for the pool's whole action set when the queries cannot use it."""
    # DeepSeek-Coder-V2 left some MMLU-Pro questions unanswered: those have fewer candidates.
    models = ["DeepSeek-Coder-V2", "Mistral-7B-Instruct-v0.2", "Yi-6b-Chat", "Qwen1.5-7B-Chat"]
    pool_file, everything = tmp_path / "pool.yaml", tmp_path / "all.parquet"
    assert cli_main(["replay", "pool", "--dataset", "mmlu_pro", "--replay-dir", str(REPLAY), "--out",
                     str(pool_file), "--models", *models]) == 0
    assert cli_main(["replay", "queries", "--dataset", "mmlu_pro", "--replay-dir", str(REPLAY),
                     "--out", str(everything)]) == 0
    t = pl.read_parquet(REPLAY / "mmlu_pro.parquet")
    answered = set(t.filter(pl.col("model") == models[0]).get_column("question_id"))
    unseen = t.filter(~pl.col("question_id").is_in(list(answered))).get_column("question_id").unique(
        maintain_order=True).to_list()[:5]
    table = pq.read_table(everything)
    queries = tmp_path / "unseen.parquet"
    pq.write_table(table.filter(pc.is_in(table.column("query_id"), pa.array(unseen))), queries)

    pool = load_pool(pool_file)
    rows = pq.read_table(queries).to_pylist()
    planner = runner.configured_planner(RunConfig(queries=queries, pool=pool_file, samples=4096,
                                                  planner_options={"sweep": True, "policy": "none"}), pool)
    planned = planner.plan([Query(index=i, **r) for i, r in enumerate(rows)], runner.planning_pool(pool), 4096)
    need = max(d[0].info["candidates"] for d in planned)
    assert need < len(action_set(pool, rows[0]["task"]))  # the pool-wide set would over-refuse

    def refused(samples: int, where) -> ConductorError | None:
        cfg = RunConfig(queries=queries, pool=pool_file, samples=samples, data_dir=where,
                        planner_options={"sweep": True, "policy": "none"})
        try:
            runner.configured_planner(cfg, pool)
        except ConductorError as e:
            return e
        return None

    assert refused(need, tmp_path / "data") is None
    assert f"has {need} candidate actions but only {need - 1} samples" in str(refused(need - 1, tmp_path / "data"))
    r = cli("run", queries, "--pool", pool_file, "--data-dir", tmp_path / "data", "--quiet",
            "--samples", need - 1, "--planner-option", "sweep=true", "--planner-option", "policy=none")
    _refused_before_any_run_folder(r, tmp_path / "data", f"or --samples {need} or more with `conductor run`")


def test_rewards_cost_usd_is_what_the_run_paid_and_says_so(tmp_path, fresh_sim, sample_queries):
    """Served from the cache, a plan's `cost_usd` is 0 while its reward is charged the first-paid
    cost; the column's description said only "the plan's cost", so avg(cost_usd) read as $0 plans."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    rewards = {}
    for run_id in ("first", "cached"):
        run_all(RunConfig(queries=sample_queries, pool=pool, data_dir=tmp_path / "data", run_id=run_id,
                          planner_options={"policy": "none"}, progress=False,
                          rewards=RewardScheme(cost_penalty=2000.0)))
        rewards[run_id] = {x["query_index"]: x for x in pq.read_table(
            tmp_path / "data" / "runs" / run_id / "rewards.parquet").to_pylist()}
    first, cached = rewards["first"], rewards["cached"]
    assert any(x["cost_usd"] for x in first.values()) and not any(x["cost_usd"] for x in cached.values())
    assert {k: x["reward"] for k, x in cached.items()} == pytest.approx({k: x["reward"] for k, x in first.items()})
    doc = schemas.REWARDS_TABLE.column("cost_usd").doc
    assert "what this run paid for the plan" in doc and "answered from the response cache counts 0" in doc
    assert "first paid for" in doc
