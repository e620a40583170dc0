"""Conditional steps end to end: a recorded table whose answers agree or disagree on
purpose, served by `conductor replay serve` over real HTTP, and plans whose
escalation steps run only when the cheap steps' final answers disagree."""

from __future__ import annotations

import json
import re

import duckdb
import pyarrow.parquet as pq
import pytest

from conductor.errors import PlanError
from conductor.execute.engine import condition_holds
from conductor.functions import run_function
from conductor.grading import answers_agree
from conductor.planners.base import PlanDraft
from conductor.plans import Condition, Plan, Step, parse_plan
from conductor.pool import load_pool, parse_pool
from conductor.runner import RunConfig, run_all
from conductor.store import refresh_catalog
from tests import plannersim
from tests.conftest import serving, worker, write_pool
from tests.replayserve import served_table

# slow: cascade plans over the replay server
pytestmark = pytest.mark.slow

# question -> (reference, {model: recorded final answer})
RECORDED = {
    "agree": ("4", {"a": "4", "b": "4", "c": "5", "d": "6"}),  # cheap ones agree: stop after two calls
    "split": ("4", {"a": "3", "b": "4", "c": "4", "d": "9"}),  # they disagree; c settles it (majority 4)
    "chaos": ("4", {"a": "1", "b": "2", "c": "3", "d": "4"}),  # no majority after c: d decides
    "mute": ("7", {"a": "I cannot tell.", "b": "7", "c": "7", "d": "7"}),  # an unreadable answer agrees with none
}
COST = {"a": 0.001, "b": 0.002, "c": 0.01, "d": 0.05}  # recorded USD per call


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("cascade")
    rows = [{"question_id": f"q-{name}", "question": f"Question {name}: what is the number?", "reference": ref,
             "model": m, "response": ans if not ans[0].isdigit() else f"Working...\nAnswer: {ans}",
             "correct": ans == ref, "task": "math", "cost_usd": COST[m]}
            for name, (ref, answers) in RECORDED.items() for m, ans in answers.items()]
    with served_table(d, rows, "cascade_logs") as served:
        yield served


def _run(served, monkeypatch, run_id, planner=None, **kw):
    monkeypatch.setenv("CONDUCTOR_REPLAY_URL", served["server"].url)
    data = served["dir"] / "data"
    summary = run_all(RunConfig(queries=served["queries"], pool=served["pool"], data_dir=data, run_id=run_id,
                                progress=False, cache=False, **kw), planner=planner)
    out = data / "runs" / summary["run_id"]
    traces = pq.read_table(out / "traces.parquet").to_pylist()
    results = {r["query_id"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}
    rewards = {r["query_id"]: r for r in pq.read_table(out / "rewards.parquet").to_pylist()}
    steps: dict[str, dict[int, dict]] = {}
    for t in traces:
        steps.setdefault(t["query_id"], {})[t["step"]] = t
    return steps, results, rewards


def test_a_two_level_cascade_pays_for_escalations_only_when_answers_disagree(served, monkeypatch):
    steps, results, rewards = _run(served, monkeypatch, "cascade",
                                   planner_options={"policy": "none", "action": "cascade:a+b>c>d"})
    status = {q: [steps[q][i]["status"] for i in range(4)] for q in steps}
    assert status == {"q-agree": ["ok", "ok", "skipped", "skipped"],
                      "q-split": ["ok", "ok", "ok", "skipped"],
                      "q-chaos": ["ok", "ok", "ok", "ok"],
                      "q-mute": ["ok", "ok", "ok", "skipped"]}
    skipped = steps["q-agree"][2]
    assert skipped["cost_usd"] == 0 and skipped["attempts"] == 0 and skipped["response_text"] is None
    assert skipped["error"] == "condition disagree(0, 1) is false: steps 0, 1 agree"
    assert steps["q-split"][3]["error"] == "condition no_majority(0, 1, 2) is false: 2 of steps 0, 1, 2 agree"
    # The answer is the last step that ran; the cost is what ran.
    assert results["q-agree"]["final_answer"].endswith("Answer: 4")
    assert results["q-chaos"]["final_answer"].endswith("Answer: 4")
    assert results["q-agree"]["cost_usd"] == pytest.approx(COST["a"] + COST["b"])
    assert results["q-split"]["cost_usd"] == pytest.approx(COST["a"] + COST["b"] + COST["c"])
    assert results["q-chaos"]["cost_usd"] == pytest.approx(sum(COST.values()))
    assert {q: r["calls"] for q, r in results.items()} == {"q-agree": 2, "q-split": 3, "q-chaos": 4, "q-mute": 3}
    assert all(r["correct"] for r in rewards.values())
    assert all(r["status"] == "ok" for r in results.values())


class Fixed:
    name = "fixed"

    def __init__(self, steps):
        self.steps = steps

    def plan(self, queries, pool, samples):
        return [[PlanDraft(text=json.dumps({"steps": self.steps(q)}))] * samples for q in queries]


def test_vote_and_extract_work_inside_a_cascade(served, monkeypatch):
    def plan(q):
        ask = q.prompt
        return [{"worker": "a", "instruction": ask, "access": []},
                {"worker": "b", "instruction": ask, "access": []},
                {"worker": "c", "instruction": ask, "access": [], "when": "disagree(0, 1)"},
                {"worker": "vote", "instruction": "Vote.", "access": "all"},
                {"worker": "extract", "instruction": "Extract.", "access": [3]}]
    steps, results, rewards = _run(served, monkeypatch, "vote", planner=Fixed(plan))
    # On q-agree the vote sees only the two steps that ran; on q-split three.
    assert steps["q-agree"][2]["status"] == "skipped"
    assert "Votes over 2 output(s): 4 x2" in steps["q-agree"][3]["response_text"]
    assert "Votes over 3 output(s)" in steps["q-split"][3]["response_text"]
    assert {q: r["final_answer"] for q, r in results.items()} == {
        "q-agree": "Answer: 4", "q-split": "Answer: 4", "q-chaos": "Answer: 1", "q-mute": "Answer: 7"}
    assert rewards["q-chaos"]["correct"] is False and rewards["q-split"]["correct"] is True


def test_a_step_that_sees_only_skipped_steps_is_skipped_and_the_answer_stays(served, monkeypatch):
    def plan(q):
        ask = q.prompt
        return [{"worker": "a", "instruction": ask, "access": []},
                {"worker": "b", "instruction": ask, "access": []},
                {"worker": "c", "instruction": ask, "access": [], "when": "disagree(0, 1)"},
                {"worker": "vote", "instruction": "Vote.", "access": [2]},
                {"worker": "extract", "instruction": "Extract.", "access": [3]}]
    steps, results, _ = _run(served, monkeypatch, "vote-after-escalation", planner=Fixed(plan))
    # The cheap pair agrees on q-agree: no escalation, so nothing for the vote and extract to read.
    assert [steps["q-agree"][i]["status"] for i in range(5)] == ["ok", "ok", "skipped", "skipped", "skipped"]
    assert steps["q-agree"][3]["error"] == "every step it may see (2) was skipped by its condition"
    assert results["q-agree"]["status"] == "ok" and results["q-agree"]["final_answer"].endswith("Answer: 4")
    assert results["q-agree"]["cost_usd"] == pytest.approx(COST["a"] + COST["b"])
    assert [steps["q-split"][i]["status"] for i in range(5)] == ["ok"] * 5
    assert results["q-split"]["final_answer"] == "Answer: 4"
    assert all(r["status"] == "ok" for r in results.values())


def test_a_vote_or_extract_that_sees_no_step_is_refused(served):
    pool = load_pool(served["pool"])
    for fn in ("vote", "extract"):
        text = json.dumps({"steps": [{"worker": "a", "instruction": "Q", "access": []},
                                     {"worker": fn, "instruction": "Combine.", "access": []}]})
        with pytest.raises(PlanError, match=rf"step 1: {fn} \({fn}\) combines earlier steps' answers, so its "
                                             r"access must list at least one earlier step"):
            parse_plan(text, pool)


def test_the_fourth_list_and_a_bad_condition(served, monkeypatch):
    text = ('model_id = ["a", "b", "d"]\nsubtasks = ["Q", "Q", "Q"]\naccess_list = [[], [], []]\n'
            'conditions = [None, None, "disagree(0, 1)"]')

    class ThreeLists(Fixed):
        def plan(self, queries, pool, samples):
            return [[PlanDraft(text=text.replace('"Q"', json.dumps(q.prompt)))] * samples for q in queries]

    steps, results, _ = _run(served, monkeypatch, "lists", planner=ThreeLists(None))
    assert steps["q-agree"][2]["status"] == "skipped" and steps["q-chaos"][2]["status"] == "ok"
    bad = Fixed(lambda q: [{"worker": "a", "instruction": q.prompt, "access": []},
                           {"worker": "b", "instruction": q.prompt, "access": [], "when": {"disagree": [0, 1]}}])
    _, results, _ = _run(served, monkeypatch, "bad", planner=bad)
    assert {r["status"] for r in results.values()} == {"invalid_plan"}
    assert all("step 1: condition disagree reads step 1, which is not earlier" in r["error"]
               for r in results.values())


# ---- the workflow language: conditions in every format ----------------------

POOL = parse_pool({"workers": [
    {"id": "small", "model": "openai/small"}, {"id": "mid", "model": "openai/mid"},
    {"id": "big", "model": "openai/big"}, {"id": "vote", "kind": "function"},
    {"id": "extract", "kind": "function"}]})


def _three(when_field: str, spelling) -> str:
    steps = [{"worker": "small", "instruction": "Q", "access": []},
             {"worker": "mid", "instruction": "Q", "access": []},
             {"worker": "big", "instruction": "Q", "access": [], when_field: spelling}]
    return json.dumps({"steps": steps})


@pytest.mark.parametrize("field, spelling", [
    ("when", {"disagree": [0, 1]}), ("when", {"disagree": [1, "0"]}), ("if", {"disagree": [0, 1]}),
    ("when", "disagree(0, 1)"), ("when", " Disagree (0,1) "), ("condition", {"kind": "disagree", "steps": [0, 1]}),
])
def test_every_spelling_of_a_condition_reads_as_the_same_step(field, spelling):
    plan = parse_plan(_three(field, spelling), POOL)
    assert plan.steps[2].when == Condition("disagree", (0, 1))
    assert plan.steps[2].waits_for == (0, 1) and plan.steps[0].when is None
    # The canonical JSON names it one way and loads back to the same plan.
    assert json.loads(plan.to_json())["steps"][2] == {"worker": "big", "instruction": "Q", "access": [],
                                                      "when": {"disagree": [0, 1]}}
    assert "when" not in json.loads(plan.to_json())["steps"][0]
    assert Plan.from_json(plan.to_json()) == plan


def test_a_step_waits_for_what_it_sees_and_what_its_condition_reads():
    plan = parse_plan(json.dumps({"steps": [
        {"worker": "small", "instruction": "Q", "access": []}, {"worker": "mid", "instruction": "Q", "access": []},
        {"worker": "big", "instruction": "Q", "access": []},
        {"worker": "big", "instruction": "Q", "access": [2], "when": {"no_majority": [0, 1, 2]}}]}), POOL)
    assert plan.steps[3].access == (2,) and plan.steps[3].waits_for == (0, 1, 2)
    assert Plan.from_json(plan.to_json()).steps[3].when == Condition("no_majority", (0, 1, 2))


@pytest.mark.parametrize("fourth", [
    '[None, None, "disagree(0, 1)"]', '[null, "", {"disagree": [0, 1]}]',
    '[None, "none", {"kind": "disagree", "steps": [0, 1]}]'])
def test_the_fourth_list_in_any_spelling(fourth):
    text = ('Two cheap ones, then the big one if they differ.\nmodel_id = ["small", 1, "big"]\n'
            'subtasks = ["Q", "Q", "Q"]\naccess_list = [[], [], []]\nconditions = ' + fourth)
    plan = parse_plan(text, POOL)
    assert [s.when for s in plan.steps] == [None, None, Condition("disagree", (0, 1))]
    assert parse_plan(text.split("\nconditions")[0], POOL).steps[2].when is None  # the fourth list is optional


@pytest.mark.parametrize("spelling, message", [
    ({"agree": [0, 1]}, "step 2: unknown condition 'agree' (known: disagree, no_majority)"),
    ("sometimes", "step 2: condition 'sometimes' is not of the form disagree(0, 1)"),
    ("disagree(0, x)", "step 2: condition 'disagree(0, x)': the steps must be step numbers"),
    ({"disagree": [0]}, "step 2: condition disagree needs a list of at least two earlier steps"),
    ({"disagree": [1, 1]}, "step 2: condition disagree needs at least two different steps (got [1, 1])"),
    ({"disagree": [0, 2]}, "step 2: condition disagree reads step 2, which is not earlier"),
    ({"no_majority": [0, 5]}, "step 2: condition no_majority reads step 5, which is not earlier"),
    ({"disagree": [0, -1]}, "step 2: condition disagree: -1 is not a step number"),
    ({"disagree": [0, True]}, "step 2: condition disagree: True is not a step number"),
    ({"disagree": 1}, "step 2: condition disagree needs a list of at least two earlier steps (got 1)"),
    ({"disagree": [0, 1], "no_majority": [0, 1]}, "step 2: condition must be like"),
    (["disagree", 0, 1], "step 2: condition must be like"),
])
def test_a_bad_condition_is_refused_naming_the_step(spelling, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        parse_plan(_three("when", spelling), POOL)


def test_the_fourth_list_must_match_the_others():
    text = 'model_id = ["small", "mid"]\nsubtasks = ["Q", "Q"]\naccess_list = [[], []]\nconditions = [None]'
    with pytest.raises(PlanError, match="list lengths differ: model_id has 2, conditions 1"):
        parse_plan(text, POOL)
    with pytest.raises(PlanError, match="step 1: condition disagree reads step 1, which is not earlier"):
        parse_plan(text.replace("[None]", '[None, "disagree(0, 1)"]'), POOL)


@pytest.mark.parametrize("kind, answers, ran, holds, why", [
    ("disagree", ["Answer: 4", "Answer: 4.0"], [0, 1], False, "steps 0, 1 agree"),  # the math grader's equality
    ("disagree", ["Answer: 4", "Answer: 5"], [0, 1], True, "steps 0, 1 disagree"),
    ("disagree", ["no idea", "no idea"], [0, 1], True, "steps 0, 1 disagree"),  # unreadable agrees with nothing
    ("disagree", ["Answer: 4", None], [0], False, "only step 0 ran"),
    ("no_majority", ["Answer: 4", "Answer: 5", "Answer: 4"], [0, 1, 2], False, "2 of steps 0, 1, 2 agree"),
    ("no_majority", ["Answer: 4", "Answer: 5", None], [0, 1], True, "no majority among steps 0, 1"),
    ("no_majority", ["Answer: 4", "Answer: 5", "Answer: 6"], [0, 1, 2], True, "no majority among steps 0, 1, 2"),
    ("no_majority", [None, None, None], [], True, "no majority among steps "),  # nothing ran: escalate
])
def test_condition_semantics_on_the_steps_that_ran(kind, answers, ran, holds, why):
    outputs = {j: answers[j] for j in ran}
    assert condition_holds(Condition(kind, tuple(range(len(answers)))), outputs, "math") == (holds, why)


def test_vote_and_extract_ignore_skipped_inputs():
    step = Step("vote", "Vote.", (0, 1, 2))
    assert run_function("vote", step, ["Answer: 3", None, "Answer: 3.0"], "math").startswith(
        "Votes over 2 output(s): 3 x2")
    assert run_function("extract", step, [None, "so it is 12\nAnswer: 12"], "math") == "Answer: 12"
    with pytest.raises(ValueError, match="none of the granted steps ran"):
        run_function("vote", step, [None, None], "math")
    with pytest.raises(ValueError, match="extract needs access to exactly one earlier step that ran"):
        run_function("extract", step, [None, None], "math")


# ---- the simulated planner writes cascades; they run over real HTTP ----------

CASCADE_SIM = {
    "cheap-a": {"skill": 0.5, "latency_ms": 2}, "cheap-b": {"skill": 0.5, "latency_ms": 2},
    "strong": {"skill": 0.95, "latency_ms": 2},
    "casc-planner": {"role": "planner", "cascade_rate": 1.0, "latency_ms": 2},
}


@pytest.fixture(scope="module")
def cascade_sim(tmp_path_factory):
    d = tmp_path_factory.mktemp("cascade-sim")
    with serving(d, CASCADE_SIM) as handle:
        yield {"handle": handle, "queries": plannersim.math_queries(d / "math.parquet", 12)}


@pytest.mark.parametrize("structured", ["on", "off"])
def test_sim_planned_cascades_run_and_the_catalog_shows_skipped_steps(cascade_sim, tmp_path, structured):
    url = cascade_sim["handle"].url
    pool = write_pool(tmp_path / "pool.yaml", url, workers=[
        worker("cheap-a", url), worker("cheap-b", url), worker("strong", url),
        plannersim.planner_worker(url, model="casc-planner")])
    data = tmp_path / "data"
    summary = run_all(RunConfig(queries=cascade_sim["queries"], pool=pool, data_dir=data, progress=False,
                                planner="llm", samples=2, cache=False,
                                planner_options={"worker": "conductor", "structured": structured}))
    run_dir = data / "runs" / summary["run_id"]
    plans = pq.read_table(run_dir / "plans.parquet").to_pylist()
    assert all(p["valid"] for p in plans)
    if structured == "off":
        assert all("\nconditions = [null,null,\"disagree(0, 1)\"]" in p["raw_text"] for p in plans)  # the fourth list
    assert all(len(json.loads(p["steps_json"])["steps"]) == 3 for p in plans)

    con = duckdb.connect(str(refresh_catalog(data)), read_only=True)
    rows = con.execute("""SELECT t.plan_id, t.step, t.status, t."when", t.cost_usd, t.attempts, t.error,
                                 t.response_text, r.final_answer, r.cost_usd AS plan_cost, t.cache_hit
                          FROM traces t JOIN results r USING (plan_id) ORDER BY t.plan_id, t.step""").fetchall()
    con.close()
    by_plan: dict[str, list[tuple]] = {}
    for row in rows:
        by_plan.setdefault(row[0], []).append(row)
    assert len(by_plan) == 24
    kinds = set()
    for steps in by_plan.values():
        first, second, third = steps
        assert first[3] is None and second[3] is None and third[3] == "disagree(0, 1)"
        agree = answers_agree("math", first[7], second[7])
        kinds.add(agree)
        if agree:  # the escalation costs nothing, calls nothing, and the answer is the second step's
            assert third[2:6] == ("skipped", "disagree(0, 1)", 0.0, 0) and not third[10]
            assert third[6] == "condition disagree(0, 1) is false: steps 0, 1 agree"
            assert third[8] == second[7] and third[9] == pytest.approx(first[4] + second[4])
        else:
            # called (or answered by this run's cache: two samples may share a request)
            assert third[2] == "ok" and (third[5] == 1 or third[10]) and third[8] == third[7]
            assert third[9] == pytest.approx(first[4] + second[4] + third[4])
    assert kinds == {True, False}  # both paths were taken


def test_bad_cascade_rate_is_refused():
    from conductor.sim.config import SimConfigError, served_models

    pool = parse_pool({"workers": [{"id": "p", "kind": "planner", "model": "openai/p",
                                    "simulate": {"role": "planner", "cascade_rate": -0.1}}]})
    message = "worker p: simulate.cascade_rate: must be a fraction in [0, 1]"
    with pytest.raises(SimConfigError, match=re.escape(message)):
        served_models(pool)
