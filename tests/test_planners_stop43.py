"""audit80 F1, F2, F7: `--max-depth 0` leaves planner workers out of a model planner's plans (their steps
failed after the plan's earlier steps were paid for), an unreachable `--planner-option api_base` is named as
that option, and the checks before planning say every problem they find at once."""

from __future__ import annotations

import shutil

import orjson
import pyarrow.parquet as pq
import pytest

from conductor.errors import ConductorError
from conductor.planners import make_planner
from conductor.pool import load_pool
from conductor.runner import RunConfig, configured_planner, plan_stage, prepare, run_all
from tests import plannersim
from tests.conftest import cli, worker, write_pool
from tests.plannersim import psim, queries, sim  # noqa: F401  (shared fixtures)

pytestmark = pytest.mark.slow  # the LLM planner over HTTP

DOWN = "http://127.0.0.1:1/v1"  # nothing listens there


def replanning_pool(tmp_path, url: str):
    """fast, weak, vote, and the planner worker `conductor`, whose model puts a re-planning step after
    the first of every plan it may (replan_rate 1)."""
    return plannersim.pool_file(tmp_path / "pool.yaml", url,
                                planner=plannersim.planner_worker(url, model="sim-replanner"))


def run(tmp_path, pool, queries, data="data", **kw):
    cfg = RunConfig(queries=queries, pool=pool, data_dir=tmp_path / data, progress=False, planner="llm",
                    samples=2, **kw)
    summary = run_all(cfg)
    return summary, tmp_path / data / "runs" / summary["run_id"]


def plans_of(run_dir) -> list[dict]:
    return pq.read_table(run_dir / "plans.parquet").sort_by([("plan_id", "ascending")]).to_pylist()


def planner_calls(sim) -> int:
    return sim.log()["by_model"].get("sim-replanner", 0)


def runs_in(data) -> list[str]:
    return sorted(p.name for p in (data / "runs").iterdir()) if (data / "runs").exists() else []


# ---- F1: --max-depth 0 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("structured", ["on", "off"])
def test_max_depth_0_leaves_the_planner_worker_out_of_the_llm_planners_plans(sim, tmp_path, queries,
                                                                              structured):
    """The prompt and schema offered `conductor` at --max-depth 0; the executor then refused each of its
    steps after the plan's earlier steps were paid for (audit80: 8 of 20 plans failed, exit 4)."""
    pool = replanning_pool(tmp_path, sim.url)
    options = {"worker": "conductor", "structured": structured}
    summary, run_dir = run(tmp_path, pool, queries, max_depth=0, planner_options=options)
    plans = plans_of(run_dir)
    assert len(plans) == 24 and all(p["valid"] for p in plans)
    assert not any("conductor" in p["workers"] for p in plans)
    assert summary["exit_code"] == 0 and set(summary["statuses"]) == {"ok"}, summary["statuses"]
    system = orjson.loads(plans[0]["planner_prompt"])[0]["content"]
    assert "conductor [planner]" not in system and "fast [llm]" in system

    # The same command at depth 1 (another data folder): the same run id, and plans that re-plan.
    summary1, run_dir1 = run(tmp_path, pool, queries, data="data1", max_depth=1, planner_options=options)
    assert summary1["run_id"] == summary["run_id"]  # max_depth stays outside the run id
    assert any("conductor" in p["workers"] for p in plans_of(run_dir1))
    system1 = orjson.loads(plans_of(run_dir1)[0]["planner_prompt"])[0]["content"]
    assert "conductor [planner]" in system1


def test_a_rerun_with_another_depth_keeps_the_run_and_its_plans(sim, tmp_path, queries):
    pool = replanning_pool(tmp_path, sim.url)
    options = {"worker": "conductor", "structured": "on"}
    summary, run_dir = run(tmp_path, pool, queries, max_depth=0, planner_options=options)
    assert summary["exit_code"] == 0, summary["failures"]
    before, sent = plans_of(run_dir), planner_calls(sim)
    again, _ = run(tmp_path, pool, queries, max_depth=1, planner_options=options)
    assert again["run_id"] == summary["run_id"] and again["resumed"]
    assert plans_of(run_dir) == before and planner_calls(sim) == sent  # nothing planned again
    assert any("--max-depth 1 changed nothing" in n for n in again["notes"]), again["notes"]


def test_plans_left_to_make_follow_the_depth_the_run_was_made_with(sim, tmp_path, queries):
    """Planning stopped before its table was written, resumed with another --max-depth: the plans left are
    made as the first were (the run decided it when it was made), so the planner's answers come from its
    run cache, not paid again, and the run's plans are all of one kind."""
    pool = replanning_pool(tmp_path, sim.url)
    options = {"worker": "conductor", "structured": "on"}
    made = RunConfig(queries=queries, pool=pool, data_dir=tmp_path / "data", run_id="pinned", samples=2,
                     planner="llm", planner_options=options, max_depth=0, progress=False)
    run0 = prepare(made, load_pool(pool))
    plan_stage(run0, configured_planner(made, load_pool(pool)))
    first, sent = plans_of(run0.dir.path), planner_calls(sim)
    assert not any("conductor" in p["workers"] for p in first)
    (run0.dir.path / "plans.parquet").unlink()  # as if stopped before the plans were gathered
    shutil.rmtree(run0.dir.work / "plan_parts")

    summary, run_dir = run(tmp_path, pool, queries, run_id="pinned", max_depth=1, planner_options=options)
    assert planner_calls(sim) == sent  # the same requests: answered by the run's own cache
    assert [p["raw_text"] for p in plans_of(run_dir)] == [p["raw_text"] for p in first]
    assert summary["exit_code"] == 0
    assert any("--max-depth 1: the plans left to make leave out the planner worker(s) conductor" in n
               for n in summary["notes"]), summary["notes"]


def test_a_run_made_with_re_planning_keeps_it_for_the_plans_left_and_says_so(sim, tmp_path, queries):
    pool = replanning_pool(tmp_path, sim.url)
    options = {"worker": "conductor", "structured": "on"}
    made = RunConfig(queries=queries, pool=pool, data_dir=tmp_path / "data", run_id="d1", samples=2,
                     planner="llm", planner_options=options, max_depth=1, progress=False)
    prepare(made, load_pool(pool))  # a run folder, no plans yet
    summary, run_dir = run(tmp_path, pool, queries, run_id="d1", max_depth=0, planner_options=options)
    assert any("conductor" in p["workers"] for p in plans_of(run_dir))  # as the run was made to plan
    assert any("--max-depth 0: the plans left to make may still give steps to the planner worker(s) "
               "conductor" in n for n in summary["notes"]), summary["notes"]


def test_max_depth_0_with_kinds_that_need_a_planner_worker_is_refused_before_anything(sim, tmp_path, queries):
    pool = replanning_pool(tmp_path, sim.url)
    data = tmp_path / "data"
    sent = sim.log()["total"]
    r = cli("run", queries, "--pool", pool, "--data-dir", data, "--planner", "llm", "--quiet", "--max-depth", "0",
            "--planner-option", "worker=conductor", "--planner-option", "kinds=planner,function")
    assert r.returncode == 2, r.stderr
    assert ("--max-depth 0 allows no re-planning, so plans leave out planner workers, and --planner-option "
            "kinds=planner,function leaves no other kind a plan can begin with; add llm to kinds, or give "
            "--max-depth 1") in r.stderr
    assert runs_in(data) == [] and sim.log()["total"] == sent


def test_max_depth_0_with_an_embedded_action_that_re_plans_is_refused_before_anything(sim, tmp_path, queries):
    """The embedded planner leaves planner workers out of its own plans; `action=` names one only when
    the user does, and its steps would fail at depth 0 after the first step was paid for."""
    pool = replanning_pool(tmp_path, sim.url)
    data = tmp_path / "data"
    sent = sim.log()["total"]
    r = cli("run", queries, "--pool", pool, "--data-dir", data, "--quiet", "--max-depth", "0",
            "--planner-option", "action=verify:fast>conductor")
    assert r.returncode == 2, r.stderr
    assert ("--max-depth 0 allows no re-planning, but --planner-option action gives a step to the planner "
            "worker(s) conductor, which re-plan; choose an action without them, or give --max-depth 1") in r.stderr
    assert runs_in(data) == [] and sim.log()["total"] == sent


# ---- F2: the options the user typed -------------------------------------------------------------------

def test_an_unreachable_planner_api_base_names_the_option(sim, tmp_path, queries):
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url)
    data = tmp_path / "data"
    r = cli("run", queries, "--pool", pool, "--data-dir", data, "--planner", "llm", "--quiet",
            "--planner-model", "openai/sim-planner", "--planner-option", f"api_base={DOWN}")
    assert r.returncode == 2, r.stderr
    assert (f"LLM planner: cannot plan: --planner-model openai/sim-planner: cannot reach {DOWN} (") in r.stderr
    assert "; start the server or fix --planner-option api_base" in r.stderr, r.stderr
    assert "conductor-planner" not in r.stderr and "pool file" not in r.stderr
    assert runs_in(data) == []


def test_a_hosted_planner_model_without_its_key_names_the_option(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    pool = load_pool(plannersim.pool_file(tmp_path / "pool.yaml", DOWN))
    with pytest.raises(ConductorError) as refused:
        make_planner("llm", model="openai/gpt-4o").ready(pool)
    assert str(refused.value) == (
        "LLM planner: cannot plan: --planner-model openai/gpt-4o: model openai/gpt-4o needs OPENAI_API_KEY, which "
        "is not set; set it, or name the variable that holds its key with --planner-option api_key_env=NAME")


def test_a_pool_workers_unreachable_endpoint_still_names_the_pool_file(tmp_path):
    from conductor.preflight import preflight

    pool = load_pool(write_pool(tmp_path / "pool.yaml", DOWN))
    [line] = preflight(pool, ["fast", "weak"])
    assert line.startswith(f"workers fast, weak: cannot reach {DOWN} (")
    assert line.endswith("; start the server or fix api_base in the pool file"), line


# ---- F7: every problem at once ------------------------------------------------------------------------

def test_an_unset_key_no_longer_hides_the_endpoint_and_model_problems(sim, tmp_path, queries, monkeypatch):
    """The variable alone was said; the endpoint down and the model not served came on the next attempt."""
    monkeypatch.delenv("STOP43_UNSET_KEY", raising=False)
    workers = [worker("fast", sim.url, provider="keyed"), worker("ghost", sim.url), worker("down", DOWN),
               plannersim.planner_worker(sim.url, provider="plan")]
    pool = write_pool(tmp_path / "pool.yaml", sim.url, workers=workers,
                      providers={"sim": {}, "keyed": {"api_key_env": "STOP43_UNSET_KEY"}, "plan": {}})
    data = tmp_path / "data"
    sent = sim.log()["total"]
    r = cli("run", queries, "--pool", pool, "--data-dir", data, "--planner", "llm", "--quiet",
            "--planner-option", "worker=conductor")
    assert r.returncode == 2 and "cannot start planning (nothing was written or called)" in r.stderr, r.stderr
    assert "environment variable STOP43_UNSET_KEY is not set (needed by fast)" in r.stderr
    assert f"worker down: cannot reach {DOWN}" in r.stderr
    assert "worker ghost: " in r.stderr and "does not serve model 'ghost'" in r.stderr
    assert runs_in(data) == [] and sim.log()["total"] == sent


def test_the_planners_own_unset_key_and_unreachable_endpoint_are_said_together(tmp_path, queries, monkeypatch):
    monkeypatch.delenv("STOP43_PLANNER_KEY", raising=False)
    pool = plannersim.pool_file(tmp_path / "pool.yaml", DOWN)
    data = tmp_path / "data"
    r = cli("run", queries, "--pool", pool, "--data-dir", data, "--planner", "llm", "--quiet",
            "--planner-model", "openai/sim-planner", "--planner-option", f"api_base={DOWN}",
            "--planner-option", "api_key_env=STOP43_PLANNER_KEY")
    assert r.returncode == 2, r.stderr
    assert "LLM planner: cannot plan: environment variable STOP43_PLANNER_KEY is not set" in r.stderr
    assert f"--planner-model openai/sim-planner: cannot reach {DOWN}" in r.stderr
    assert runs_in(data) == []


def test_at_depth_0_the_planner_is_freed_before_execution(sim, tmp_path, queries, monkeypatch):
    """Nothing re-plans at depth 0 (the executor refuses a planner step before it asks), so a loaded vLLM
    engine need not be held through execution, where a kill -9 of conductor orphaned its process."""
    import conductor.runner as runner

    closed: list[bool] = []  # whether execution had begun when the runner freed the planner
    real = runner.close_planner
    monkeypatch.setattr(runner, "close_planner", lambda p: (closed.append(
        any((tmp_path / "data" / "runs").glob("*/work/steps.jsonl"))), real(p)))
    pool = replanning_pool(tmp_path, sim.url)
    summary, _ = run(tmp_path, pool, queries, max_depth=0, planner_options={"worker": "conductor"})
    assert summary["exit_code"] == 0 and closed[0] is False, closed
