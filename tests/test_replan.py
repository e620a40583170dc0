"""Recursive re-planning end to end against the simulated server: a step given to
the pool's planner worker plans and runs a sub-workflow whose last output is
the step's output; traces show the nesting; depth is bounded; a killed run
resumes without calling a finished sub-step or re-plan again."""

from __future__ import annotations

import pytest

import orjson
import pyarrow.parquet as pq

from conductor.execute.engine import StepFailed
from conductor.plans import Plan, Step
from conductor.runner import RunConfig, run_all
from tests import plannersim
from tests.conftest import kill_when_journaled, run_cli
from tests.plannersim import psim, queries, sim  # noqa: F401  (shared fixtures)
from tests.test_executor import FixedPlanner

# slow: re-planning runs against the simulated planner
pytestmark = pytest.mark.slow

VERIFY = "Check the answer above and correct it if it is wrong. End with a final line Answer: <number>"


def solve_then_replan(q):
    return [{"worker": "fast", "instruction": f"{q.prompt} End with a final line Answer: <number>", "access": []},
            {"worker": "conductor", "instruction": VERIFY, "access": [0]}]


def run(tmp_path, pool, queries, fixed=None, replanner=None, **kw):
    """run_all with `fixed` writing the top-level plans; kw configure the run (its
    planner and planner_options decide who re-plans)."""
    cfg = RunConfig(queries=queries, pool=pool, data_dir=tmp_path / "data", progress=False, **kw)
    summary = run_all(cfg, planner=fixed, replanner=replanner)
    out = tmp_path / "data" / "runs" / summary["run_id"]
    return (summary, pq.read_table(out / "traces.parquet").to_pylist(),
            pq.read_table(out / "results.parquet").to_pylist())


def by_plan(traces):
    out: dict[str, dict[str, dict]] = {}
    for t in traces:
        out.setdefault(t["plan_id"], {})[t["step_path"]] = t
    return out


def test_a_planner_step_runs_a_nested_workflow_and_traces_show_it(sim, tmp_path, queries):
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=plannersim.planner_worker(sim.url))
    summary, traces, results = run(tmp_path, pool, queries, FixedPlanner(solve_then_replan), planner="llm",
                                   planner_options={"worker": "conductor", "structured": "on"})
    assert summary["statuses"] == {"ok": 12}
    final = {r["plan_id"]: r["final_answer"] for r in results}
    for plan_id, rows in by_plan(traces).items():
        planning, step = rows["1.plan"], rows["1"]
        sub = orjson.loads(planning["sub_plan"])
        subpaths = sorted(p for p in rows if p.startswith("1.") and p != "1.plan")
        assert subpaths == [f"1.{i}" for i in range(len(sub["steps"]))]
        # The planner's own call: a paid, cached call at depth 1, that holds the sub-plan it wrote.
        assert planning["worker"] == "conductor" and planning["model"] == "openai/sim-planner"
        assert planning["depth"] == 1 and planning["step"] == 1 and planning["attempts"] == 1
        assert planning["cost_usd"] > 0 and planning["request_key"]
        assert orjson.loads(planning["response_text"]) == sub  # structured: the raw plan is the sub-plan
        for p in subpaths:
            assert rows[p]["depth"] == 1 and rows[p]["step"] == 1 and rows[p]["status"] == "ok"
            assert rows[p]["worker"] == sub["steps"][int(p[2:])]["worker"]
        # The sub-plan sees the work so far only through its instructions, and cannot re-plan again.
        assert "conductor" not in {s["worker"] for s in sub["steps"]}
        assert rows["0"]["depth"] == 0
        # The re-planning step's row: depth 0, the sub-plan, and the sub-workflow's last output.
        assert step["depth"] == 0 and step["status"] == "ok" and orjson.loads(step["sub_plan"]) == sub
        assert step["response_text"] == rows[subpaths[-1]]["response_text"] == final[plan_id]
    # The re-planning prompt showed the planner the earlier step's work and the step's instruction.
    assert sim.log()["by_model"]["sim-planner"] == 12
    results_calls = {r["plan_id"]: r["calls"] for r in results}
    for plan_id, rows in by_plan(traces).items():
        assert results_calls[plan_id] == sum(1 for r in rows.values() if r["attempts"])


def test_free_mode_and_the_embedded_planner_also_re_plan(sim, tmp_path, queries):
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=plannersim.planner_worker(sim.url))
    _, traces, results = run(tmp_path, pool, queries, FixedPlanner(solve_then_replan), planner="llm",
                             planner_options={"worker": "conductor", "structured": "off"}, run_id="free")
    assert {r["status"] for r in results} == {"ok"}
    for rows in by_plan(traces).values():
        assert rows["1.plan"]["response_text"].startswith("Reasoning: ")  # raw text kept, sub-plan parsed
        assert orjson.loads(rows["1"]["sub_plan"]) == orjson.loads(rows["1.plan"]["sub_plan"])

    # The embedded planner has no model: its templates plan the sub-workflow over the earlier output.
    bare = plannersim.planner_worker(sim.url)
    del bare["model"], bare["api_base"], bare["price"]
    pool = plannersim.pool_file(tmp_path / "bare.yaml", sim.url, planner=bare)
    sent = sim.log()["total"]
    _, traces, results = run(tmp_path, pool, queries, FixedPlanner(solve_then_replan), run_id="embedded",
                             cache=False)
    assert {r["status"] for r in results} == {"ok"}
    for rows in by_plan(traces).values():
        planning = rows["1.plan"]
        assert planning["attempts"] == 0 and planning["cost_usd"] == 0 and planning["model"] is None
        first = Plan.from_json(planning["sub_plan"]).steps[0]
        assert rows["0"]["response_text"] in first.instruction and VERIFY in first.instruction
        assert rows["1.0"]["depth"] == 1
    workers = sum(len(rows) - 2 for rows in by_plan(traces).values())  # every row but "1" and "1.plan" called
    assert sim.log()["total"] - sent == workers


def test_a_planner_worker_without_a_model_re_plans_with_the_run_planner_model(sim, tmp_path, queries):
    bare = plannersim.planner_worker(sim.url)
    del bare["model"], bare["api_base"], bare["price"]
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=bare)
    options = {"model": "openai/sim-planner", "api_base": sim.url, "price": plannersim.PLANNER_PRICE}
    _, traces, results = run(tmp_path, pool, queries, FixedPlanner(solve_then_replan), planner="llm",
                             planner_options=options)
    assert {r["status"] for r in results} == {"ok"}
    for rows in by_plan(traces).values():
        planning = rows["1.plan"]
        assert rows["1"]["worker"] == "conductor"  # the step names the pool's planner worker...
        assert (planning["worker"], planning["model"], planning["provider"]) == (  # ...the run's planner answers
            "conductor-planner", "openai/sim-planner", "openai")
        assert planning["cost_usd"] > 0 and planning["attempts"] == 1
    assert sim.log()["by_model"]["sim-planner"] == 12


def test_depth_is_bounded_with_a_clear_error(sim, tmp_path, queries):
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=plannersim.planner_worker(sim.url))
    _, traces, results = run(tmp_path, pool, queries, FixedPlanner(solve_then_replan), planner="llm",
                             planner_options={"worker": "conductor"}, max_depth=0, run_id="flat")
    assert {r["status"] for r in results} == {"error"}
    for r in results:
        assert "step 1 would re-plan at depth 1, deeper than the maximum depth 0" in r["error"]
        assert "--max-depth" in r["error"]
    assert "sim-planner" not in sim.log()["by_model"]  # refused before any planning call
    assert not [t for t in traces if "." in t["step_path"]]

    # A planner that ignores the bound (here: a sub-plan that re-plans again) is stopped by the executor.
    async def stubborn(ex, req):
        return Plan((Step("fast", VERIFY, ()), Step("conductor", VERIFY, (0,))))

    _, traces, results = run(tmp_path, pool, queries, FixedPlanner(solve_then_replan), replanner=stubborn,
                             run_id="stubborn")
    assert {r["status"] for r in results} == {"error"}
    rows = by_plan(traces)[results[0]["plan_id"]]
    assert rows["1.0"]["status"] == "ok" and rows["1.plan"]["status"] == "ok"
    assert "step 1.1 would re-plan at depth 2, deeper than the maximum depth 1" in rows["1.1"]["error"]
    assert "sub-workflow of step 1 failed" in rows["1"]["error"]

    # A failing re-plan keeps its status: a budget stop stays retryable, not a final error.
    async def broke(ex, req):
        raise StepFailed("budget_exhausted", "budget exhausted: run cap $0")

    summary, _, results = run(tmp_path, pool, queries, FixedPlanner(solve_then_replan), replanner=broke,
                              run_id="broke")
    assert summary["statuses"] == {"budget_exhausted": 12}
    assert "re-planning step 1 failed: budget exhausted" in results[0]["error"]


def _rows(run_dir):
    path = run_dir / "work" / "steps.jsonl"
    out = []
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            pass  # torn by the kill
    return out


TRACE_COLS = ["plan_id", "step_path", "depth", "worker", "status", "instruction", "response_text", "sub_plan"]


def test_a_killed_run_resumes_without_calling_finished_sub_steps_again(sim, tmp_path, queries):
    for model in ("fast", "weak"):
        sim.set_faults(model, latency_ms=60, latency_sd_ms=20)
    sim.set_faults("sim-replanner", latency_ms=40, latency_sd_ms=10)
    # Every step after the first hands the rest of the work to the planner.
    planner = plannersim.planner_worker(sim.url, model="sim-replanner")
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=planner,
                                providers={"sim": {"max_concurrency": 6}})
    args = ["run", str(queries), "--pool", str(pool), "--planner", "llm", "--planner-option", "worker=conductor",
            "--samples", "2", "--quiet", "--no-cache"]
    ref = run_cli(*args, "--data-dir", tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    ref_dir = next((tmp_path / "ref" / "runs").iterdir())
    expected = pq.read_table(ref_dir / "traces.parquet", columns=TRACE_COLS).to_pylist()
    n = len(expected)
    assert sum(t["step_path"].endswith(".plan") for t in expected) >= 10

    sim.reset()
    data = tmp_path / "data"
    checkpoints, mid_replan = [], 0
    for target in (n // 4, n // 2, (3 * n) // 4):
        kill_when_journaled(args, data, target)
        rows = _rows(next((data / "runs").iterdir()))
        done = {(r["plan_id"], r["step_path"]) for r in rows if r["status"] == "ok"}
        # Re-planning steps whose sub-workflow was cut off by the kill: the case under test.
        mid_replan += sum(1 for p, s in done if s.endswith(".plan") and (p, s[:-5]) not in done)
        checkpoints.append(({r["request_key"] for r in rows if r["status"] == "ok" and r["attempts"]},
                            sim.log()["by_request_key"]))
    assert mid_replan > 0, "no kill fell inside a sub-workflow; make the workers slower"

    final = run_cli(*args, "--data-dir", data)
    assert final.returncode == 0, final.stderr
    run_dir = next((data / "runs").iterdir())
    assert pq.read_table(run_dir / "traces.parquet", columns=TRACE_COLS).to_pylist() == expected
    sent = sim.log()["by_request_key"]
    for finished, sent_then in checkpoints:
        again = [k for k in finished if sent.get(k) != sent_then.get(k)]
        assert again == [], f"{len(again)} finished call(s), sub-steps or re-plans, were sent again"
    # Each sub-plan was planned once and restored from the journal afterwards, not planned again.
    plans = [(r["plan_id"], r["step_path"]) for r in _rows(run_dir) if r["step_path"].endswith(".plan")
             and r["status"] == "ok"]
    assert len(plans) == len(set(plans))
