"""Conditional steps end to end: a recorded table whose answers agree or disagree on
purpose, served by `conductor replay serve` over real HTTP, and plans whose
escalation steps run only when the cheap steps' final answers disagree."""

from __future__ import annotations

import json
import sys

import polars as pl
import pyarrow.parquet as pq
import pytest

from conductor.cli import main as cli_main
from conductor.localserver import start_server
from conductor.planners.base import PlanDraft
from conductor.replay.main import READY
from conductor.replay.process import ReplayHandle
from conductor.runner import RunConfig, run_all

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
    table = d / "cascade_logs.parquet"
    pl.DataFrame(rows).write_parquet(table)
    queries, pool = d / "queries.parquet", d / "pool.yaml"
    assert cli_main(["replay", "queries", "--table", str(table), "--split", "all", "--out", str(queries)]) == 0
    assert cli_main(["replay", "pool", "--table", str(table), "--out", str(pool)]) == 0
    cmd = [sys.executable, "-m", "conductor", "replay", "serve", "--pool", str(pool), "--port", "0"]
    with start_server(cmd, READY, ReplayHandle, "127.0.0.1", startup_timeout_s=60) as server:
        yield {"dir": d, "queries": queries, "pool": pool, "server": server}


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
