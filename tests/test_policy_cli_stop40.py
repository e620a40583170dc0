"""Audit 69 on `conductor policy`: `rollouts -k 1` without a policy explores as its banner says
(uniform draws, propensity 1/N) while `conductor run` at K=1 stays greedy; an edited `fixed.choice`,
an action naming a worker the pool lacks, or a deleted `fixed` is refused by `policy show` as by
planning; a rerun given the refusal's policy folder as a relative path resumes; `policy eval
--no-fixed` runs the learned policy when the artifact shipped its fixed action; `--lambda` just
above the cap shows the value given. Small runs over the simulated pool (test_policy_inputs) and
a made-up recorded table served by `conductor replay serve`."""

from __future__ import annotations

import json

import orjson
import pyarrow.parquet as pq
import pytest

from conductor.planners.base import Query
from conductor.planners.embedded import EmbeddedConfig, EmbeddedPlanner
from conductor.policy import artifact
from conductor.policy.actions import action_set, servable
from conductor.pool import load_pool
from tests.conftest import cli
from tests.replayserve import served_table
from tests.test_policy_audit62 import edited_copy
from tests.test_policy_inputs import logged  # noqa: F401 - a fixture, by its name


def _plans(data, run_id):
    rows = pq.read_table(data / "runs" / run_id / "plans.parquet").to_pylist()
    return [(r["task"], orjson.loads(r["info_json"]).get("action"), r["propensity"]) for r in rows if r["valid"]]


def _candidates(pool_path, task):
    pool = load_pool(pool_path)
    return len(servable(action_set(pool, task), {w.id for w in pool.workers if w.kind == "llm"}))


def _trained(logged, root, *extra):
    r = cli("policy", "train", "--pool", logged["pool"], "--runs", "explore", "--data-dir", logged["data"],
            "--out", root, "--learner", "table", *extra)
    assert r.returncode == 0, r.stderr
    return artifact.find(load_pool(logged["pool"]), root)


# F2: K=1 without a policy draws as the banner says


def test_rollouts_k1_without_a_policy_draws_uniformly_and_logs_it(logged, tmp_path):
    r = cli("policy", "rollouts", logged["queries"], "--pool", logged["pool"], "-k", "1", "--policy", "none",
            "--run-id", "k1", "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "rollouts: 1 plans per query, no learned policy (uniform over the action set), explore 1" in r.stdout
    plans = _plans(tmp_path / "data", "k1")
    assert len(plans) == 20
    for task, _, propensity in plans:
        n = _candidates(logged["pool"], task)
        assert n > 1 and propensity == pytest.approx(1 / n)  # was the prior's best, propensity 1
    assert len({a for _, a, _ in plans}) > 1


def test_k1_plans_greedily_unless_explore_is_given(logged, tmp_path):
    pool = load_pool(logged["pool"])
    queries = [Query(f"q{i}", f"What is {i} + {i}?", "math") for i in range(12)]
    greedy = EmbeddedPlanner(EmbeddedConfig(policy="none", candidates="bandit")).plan(queries, pool, 1)
    assert {d[0].propensity for d in greedy} == {1.0} and len({d[0].info["action"] for d in greedy}) == 1
    drawn = EmbeddedPlanner(EmbeddedConfig(policy="none", explore=0.5)).plan(queries, pool, 1)
    assert all(0 < d[0].propensity < 1 for d in drawn)
    # `conductor run` at K=1 with no explore option: greedy, as the README says
    r = cli("run", logged["queries"], "--pool", logged["pool"], "--planner-option", "policy=none",
            "--planner-option", "candidates=bandit", "--run-id", "g", "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 0, r.stderr
    assert {p for _, _, p in _plans(tmp_path / "data", "g")} == {1.0}
    # rollouts with --explore 0 at -k 1: greedy, and its banner says so
    r = cli("policy", "rollouts", logged["queries"], "--pool", logged["pool"], "-k", "1", "--policy", "none",
            "--explore", "0", "--run-id", "k1g", "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 0 and "greedy" in r.stdout and "uniform" not in r.stdout, r.stdout + r.stderr
    assert {p for _, _, p in _plans(tmp_path / "data", "k1g")} == {1.0}


# F3: what `policy show` accepts, planning accepts


def _edited(folder, tmp_path, edit):
    return edited_copy(folder, tmp_path / "edited" / folder.name, edit)


def _refused_by_show_and_planning(logged, folder, tmp_path, said):
    r = cli("policy", "show", "--pool", logged["pool"], "--policy", folder)
    assert r.returncode == 2 and said in r.stderr and "planning uses it" not in r.stdout, r.stdout + r.stderr
    r = cli("run", logged["queries"], "--pool", logged["pool"], "--planner-option", f"policy={folder}",
            "--run-id", "edited", "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert not (tmp_path / "data" / "runs").exists()


def test_an_edited_fixed_choice_is_refused_naming_the_saved_one(logged, tmp_path):
    folder = _trained(logged, tmp_path / "p")
    saved = orjson.loads((folder / "fixed.json").read_bytes())["choice"]
    task = sorted(saved)[0]
    r = cli("policy", "show", "--pool", logged["pool"], "--policy", folder)
    assert r.returncode == 0 and f"{task}: {saved[task]}" in r.stdout.split("\nfixed    ")[1]
    for key in ("single:nosuch", next(k for k in ("single:weak", "single:fast") if k != saved[task])):
        edited = _edited(folder, tmp_path / key.replace(":", "-"),
                         lambda m: m["fixed"]["choice"].__setitem__(task, key))
        _refused_by_show_and_planning(logged, edited, tmp_path / key.replace(":", "-"),
                                      f"field fixed.choice.{task} is '{key}', expected '{saved[task]}', "
                                      f"fixed.json's choice (which planning uses)")


def test_an_action_naming_a_worker_the_pool_lacks_is_refused_by_show(logged, tmp_path):
    folder = _trained(logged, tmp_path / "p")

    def edit(m):
        keys = next(iter(m["actions"]["by_task"].values()))
        keys[0] = "single:nosuch"

    edited = _edited(folder, tmp_path, edit)
    _refused_by_show_and_planning(logged, edited, tmp_path,
                                  f"policy {edited}: actions use worker(s) nosuch missing from the pool")


@pytest.mark.parametrize("how", ["deleted", "null"])
def test_a_deleted_fixed_record_is_refused_by_name_not_as_an_old_version(logged, tmp_path, how):
    folder = _trained(logged, tmp_path / "p")

    def edit(m):
        if how == "deleted":
            del m["fixed"]
        else:
            m["fixed"] = None

    edited = _edited(folder, tmp_path, edit)
    _refused_by_show_and_planning(logged, edited, tmp_path, f"policy {edited / 'policy.json'}: field fixed is None")
    r = cli("run", logged["queries"], "--pool", logged["pool"], "--planner-option", f"policy={edited}",
            "--planner-option", "use=fixed", "--run-id", "f", "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 2 and "trained before version 2" not in r.stderr and "field fixed is None" in r.stderr


# F4: the refusal's policy folder, given relative, resumes


def test_a_rerun_with_the_same_policy_folder_spelled_relative_or_absolute_resumes(logged, tmp_path, monkeypatch):
    folder = _trained(logged, tmp_path / "pol")
    relative = folder.relative_to(tmp_path)
    monkeypatch.chdir(tmp_path)

    def rollouts(run_id, policy):
        return cli("policy", "rollouts", logged["queries"], "--pool", logged["pool"], "-k", "2", "--policy", policy,
                   "--run-id", run_id, "--data-dir", tmp_path / "data", "--quiet")

    for run_id, first, again in (("abs", folder, relative), ("rel", relative, folder),
                                 ("dots", relative, f"./{relative.parent}/../{relative.parent.name}/{folder.name}")):
        assert rollouts(run_id, first).returncode == 0
        r = rollouts(run_id, again)
        assert r.returncode == 0 and "was planned with the policy" not in r.stderr, (run_id, r.stderr)
    manifest = orjson.loads((tmp_path / "data" / "runs" / "rel" / "manifest.json").read_bytes())
    assert manifest["inputs"]["planner_options"]["policy"] == str(folder.resolve())
    # Another version is still refused, naming both.
    _trained(logged, tmp_path / "pol")
    r = rollouts("rel", "pol")
    assert r.returncode == 2 and f"was planned with the policy v0001 ({folder.resolve()})" in r.stderr
    assert "now resolves to v0002" in r.stderr


# F7: --lambda above the cap


def test_a_lambda_just_above_the_cap_shows_the_value_given(logged, tmp_path):
    r = cli("policy", "train", "--pool", logged["pool"], "--runs", "explore", "--data-dir", logged["data"],
            "--out", tmp_path / "p", "--lambda", "1.0000001e9")
    assert r.returncode == 2 and "--lambda must be a number from 0 to 1e+09 (got 1000000100.0)" in r.stderr


# F6: --no-fixed on an artifact that shipped its fixed action


@pytest.mark.slow
def test_eval_no_fixed_runs_the_learned_policy_when_the_fixed_action_shipped(tmp_path, monkeypatch):
    d = tmp_path
    rows = []
    for i in range(40):
        ref = str(3 * i + 1)
        for model, ok, usd in (("good", i % 10 != 3, 0.01), ("cheap", i % 2 == 0, 0.001)):
            rows.append({"question_id": f"q{i:03d}", "question": f"Question {i}: what is {i} times 3, plus 1?",
                         "reference": ref, "model": model, "task": "math", "cost_usd": usd, "correct": ok,
                         "response": f"Working...\nAnswer: {ref if ok else int(ref) + 1}"})
    with served_table(d, rows, "shipfixed") as served:
        monkeypatch.setenv("CONDUCTOR_REPLAY_URL", served["server"].url)
        data, root = d / "data", d / "pol"
        for args in (("policy", "rollouts", served["queries"], "--pool", served["pool"], "-k", "4", "--policy", "none",
                      "--run-id", "r", "--data-dir", data, "--quiet"),
                     ("policy", "train", "--pool", served["pool"], "--runs", "r", "--data-dir", data, "--out", root,
                      "--learner", "table", "--lambda", "10", "--ship-margin", "1000")):
            r = cli(*args)
            assert r.returncode == 0, r.stderr
        folder = artifact.find(load_pool(served["pool"]), root)
        assert orjson.loads((folder / "policy.json").read_bytes())["shipped"] == "fixed"
        r = cli("policy", "eval", "--pool", served["pool"], "--queries", served["queries"], "--split", "all",
                "--policies", folder, "--no-planner", "--no-fixed", "--out", d / "ev")
        assert r.returncode == 0, r.stderr
        # bench/policy.py's second-round comparison runs what each artifact shipped (review40b 2)
        from conductor.evaluation import EvalConfig, evaluate

        shipped = evaluate(EvalConfig(pool=served["pool"], queries=served["queries"], split="all", out=d / "ev2",
                                      planner=False, fixed=False, shipped_only=True, policies=[folder]))
        assert [p.kind for p in shipped.policies if p.kind in ("learned", "fixed")] == ["fixed"]
    policies = json.loads((d / "ev" / "policies.json").read_text())
    kinds = [p["kind"] for p in policies["policies"] if p["kind"] in ("learned", "fixed", "fixed_cascade")]
    assert kinds == ["learned"]  # was: only the fixed action, the opposite of --help
    [row] = policies["meta"]["comparisons"]
    assert row["shipped"].startswith("learned (not shipped")
    assert "| learned (not shipped; the shipped fixed action was left out) |" in (d / "ev" / "report.md").read_text()
    assert (d / "ev" / "learned-run-0").is_dir() and not (d / "ev" / "fixed-run-0").exists()
