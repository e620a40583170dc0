"""Audit 55 on the learned policy: prices the runs were paid at, artifacts without checksums or
with an edited policy.json, `--out` and other flags checked before training, what `show` says of
a folder planning refuses, Ctrl-C on training, and the evaluation's labels. One small run over
the simulated pool, trained in a fraction of a second."""

from __future__ import annotations

import os
import signal
import stat
import time

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conductor.policy import artifact
from conductor.pool import load_pool
from conductor.runner import RunConfig, run_all
from tests.conftest import SAMPLE, cli, worker, write_pool
from tests.test_policy_inputs import sim_server


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Pool A (fast, weak) at $1/$2, a run of 20 queries x 4 uniform plans over it, the same pool
    with weak at $100/$200 (same pool key), and a run whose queries' `category` is null."""
    from conductor.sim import start_sim

    d = tmp_path_factory.mktemp("audit55")
    queries = d / "queries.parquet"
    table = pq.read_table(SAMPLE).slice(0, 20)
    pq.write_table(table, queries)
    nulls = d / "nulls.parquet"
    pq.write_table(table.set_column(4, "metadata", pa.array(['{"category": null}'] * 20)), nulls)
    with start_sim(sim_server(d), [queries]) as sim:
        pool = write_pool(d / "a.yaml", sim.url)
        dear = [worker(n, sim.url) for n in ("fast", "weak")]
        dear[1]["price"] = {"input_per_mtok": 100.0, "output_per_mtok": 200.0}
        dear_pool = write_pool(d / "dear.yaml", sim.url, workers=dear)
        options = {"policy": "none", "candidates": "bandit", "explore": 1.0}
        for run_id, q in (("explore", queries), ("nulls", nulls)):
            run_all(RunConfig(queries=q, pool=pool, data_dir=d / "data", run_id=run_id, samples=4,
                              planner_options=options, progress=False))
        yield {"dir": d, "pool": pool, "dear": dear_pool, "queries": queries, "data": d / "data"}


def _train(logged, out, *extra, pool=None, runs=("explore",)):
    return cli("policy", "train", "--pool", pool or logged["pool"], "--runs", *runs, "--data-dir", logged["data"],
               "--out", out, "--learner", "table", *extra)


def _folder(logged, root):
    return artifact.find(load_pool(logged["pool"]), root)


@pytest.fixture(scope="module")
def trained(logged, tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    assert _train(logged, root).returncode == 0
    return _folder(logged, root)


def _edited(trained, tmp_path, edit):
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(trained, folder)
    meta = orjson.loads((folder / "policy.json").read_bytes())
    meta = edit(meta)
    (folder / "policy.json").write_bytes(orjson.dumps(meta))
    return folder


# F1: the prices the costs were paid at, not --pool's


def test_training_under_other_prices_than_the_runs_says_so_and_records_the_runs_prices(logged, tmp_path):
    r = _train(logged, tmp_path / "p", pool=logged["dear"])
    assert r.returncode == 0, r.stderr
    assert "warning: the runs' costs were paid at other prices than --pool" in r.stderr
    assert "weak: $1/$2 in run(s) explore, $100/$200 in --pool" in r.stderr and "fast:" not in r.stderr
    meta = orjson.loads((_folder(logged, tmp_path / "p") / "policy.json").read_bytes())
    assert meta["pool"]["prices"]["weak"] == [pytest.approx(1e-6), pytest.approx(2e-6)]
    # Planning with the prices it was fitted under is quiet; with --pool's, the change is said.
    show = lambda pool: cli("policy", "show", "--pool", pool, "--policy", tmp_path / "p")  # noqa: E731
    assert "PRICES CHANGED" not in show(logged["pool"]).stdout
    assert "weak: $1/$2 -> $100/$200" in show(logged["dear"]).stdout
    # The same prices: nothing said.
    r = _train(logged, tmp_path / "q")
    assert r.returncode == 0 and "paid at other prices" not in r.stderr


# F2: an artifact without checksums


def test_an_artifact_without_checksums_is_refused_by_name_everywhere(logged, trained, tmp_path):
    folder = _edited(trained, tmp_path, lambda m: {k: v for k, v in m.items() if k != "checksums"})
    r = cli("policy", "show", "--pool", logged["pool"], "--policy", folder)
    assert r.returncode == 2, r.stdout
    assert f"policy {folder / 'policy.json'}: no checksums" in r.stderr
    assert "conductor policy train --runs explore" in r.stderr
    r = cli("run", logged["queries"], "--pool", logged["pool"], "--planner-option", f"policy={folder}",
            "--run-id", "nock", "--data-dir", tmp_path / "data")
    assert r.returncode == 2 and "no checksums" in r.stderr


# F3: every field of policy.json is checked


EDITS = {
    "a list": (lambda m: [], "a JSON list, not an object"),
    "an action key": (lambda m: {**m, "actions": {**m["actions"], "by_task": {
        t: ["garbage", *ks[1:]] for t, ks in m["actions"]["by_task"].items()}}}, "actions.by_task."),
    "lambda": (lambda m: {**m, "lambda": "abc"}, "field lambda is 'abc', expected a finite number >= 0"),
    "shipped": (lambda m: {**m, "shipped": "bogus"}, "field shipped is 'bogus', expected 'learned' or 'fixed'"),
    "version": (lambda m: {**m, "version": "1"}, "field version is '1'"),
    "features": (lambda m: {**m, "features": {**m["features"], "bits": "x"}}, "field features.bits"),
    "runs": (lambda m: {**m, "training": {**m["training"], "runs": [{"id": 1}]}}, "field training.runs[0].run_id"),
    "selection": (lambda m: {**m, "training": {**m["training"], "selection": {**m["training"]["selection"],
                                                                             "learned": 3}}},
                  "field training.selection is not what training writes"),
}


@pytest.mark.parametrize("what", EDITS)
def test_an_edited_policy_json_is_refused_naming_the_file_and_field(logged, trained, tmp_path, what):
    edit, said = EDITS[what]
    folder = _edited(trained, tmp_path, edit)
    r = cli("policy", "show", "--pool", logged["pool"], "--policy", folder)
    assert r.returncode == 2 and f"policy {folder / 'policy.json'}: " in r.stderr and said in r.stderr, r.stderr
    if what == "selection":
        return  # read by `show` only
    for args in (("run", logged["queries"], "--pool", logged["pool"], "--planner-option", f"policy={folder}",
                  "--run-id", "x", "--data-dir", tmp_path / "data"),
                 ("policy", "rollouts", logged["queries"], "--pool", logged["pool"], "-k", "2", "--policy", folder,
                  "--run-id", "y", "--data-dir", tmp_path / "data", "--quiet"),
                 ("policy", "eval", "--pool", logged["pool"], "--queries", logged["queries"], "--policies", folder,
                  "--out", tmp_path / "eval")):
        r = cli(*args)
        assert r.returncode == 2 and said in r.stderr, (args[0], r.stderr)


# F4, F10: flags checked before any training work


def test_out_a_file_is_refused_before_the_runs_are_read(logged, tmp_path):
    (tmp_path / "afile").write_text("x")
    for out, said in ((tmp_path / "afile", "is a file"), (tmp_path / "afile" / "sub", "is under")):
        r = cli("policy", "train", "--pool", logged["pool"], "--runs", "no-such-run", "--data-dir", logged["data"],
                "--out", out)
        assert r.returncode == 2 and f"--out {out}: {said}" in r.stderr and "Nothing was trained" in r.stderr
        assert "no-such-run" not in r.stderr  # refused before reading the runs


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_out_an_unwritable_folder_is_refused(logged, tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    r = _train(logged, tmp_path / "ro" / "p")
    assert r.returncode == 2 and "cannot write in" in r.stderr


def test_more_folds_than_queries_and_holdout_zero_are_refused(logged, tmp_path):
    r = _train(logged, tmp_path / "p", "--folds", "1000")
    assert r.returncode == 2 and "--folds 1000: more parts than the 20 queries" in r.stderr
    assert "give at most 20" in r.stderr
    r = _train(logged, tmp_path / "p", "--holdout", "0")
    assert r.returncode == 2 and "--holdout 0 holds no query back" in r.stderr and "use=learned" in r.stderr
    assert not (tmp_path / "p").exists()


def test_group_by_a_field_null_everywhere_says_it_is_null(logged, tmp_path):
    r = cli("policy", "train", "--pool", logged["pool"], "--runs", "nulls", "--data-dir", logged["data"],
            "--out", tmp_path / "p", "--learner", "segment", "--group-by", "category")
    assert r.returncode == 2 and "20 queries have it, but null" in r.stderr, r.stderr


def test_version_folders_follow_the_umask(logged, tmp_path):
    old = os.umask(0o022)
    try:
        assert _train(logged, tmp_path / "p").returncode == 0
    finally:
        os.umask(old)
    folder = _folder(logged, tmp_path / "p")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755


def test_rollouts_refuse_too_many_samples_before_the_banner(logged, tmp_path):
    r = cli("policy", "rollouts", logged["queries"], "--pool", logged["pool"], "-k", "5000",
            "--data-dir", tmp_path / "data")
    assert r.returncode == 2 and "--samples is plans per query: 1 to 4096 (got 5000)" in r.stderr
    assert "rollouts:" not in r.stdout


# F7: show says what planning would do


def test_show_refuses_a_folder_planning_refuses(logged, trained, tmp_path):
    lost = _edited(trained, tmp_path, lambda m: m)
    (lost / "policy.json").unlink()
    r = cli("policy", "show", "--pool", logged["pool"], "--policy", lost)
    assert r.returncode == 2 and f"--policy {lost}: no policy artifact there for this pool" in r.stderr
    assert "prior" not in r.stdout
    model = next(p for p in trained.iterdir() if p.name != "policy.json")
    r = cli("policy", "show", "--pool", logged["pool"], "--policy", model)
    assert r.returncode == 2 and "is a file; give a policy folder" in r.stderr


# F8: Ctrl-C and SIGTERM on training


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_training_says_a_rerun_starts_over(logged, tmp_path, monkeypatch, how):
    from conductor.policy import training

    def stop(*a, **k):
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # interrupted by the signal's KeyboardInterrupt at once

    monkeypatch.setattr(training, "fit_policy", stop)
    r = _train(logged, tmp_path / "p")
    assert r.returncode == (130 if how == "ctrl-c" else 143), r.stderr
    word = "interrupted" if how == "ctrl-c" else "terminated"
    assert f"{word}: policy train keeps nothing" in r.stderr and "train again from the start" in r.stderr
    assert "resume" not in r.stderr and not list(tmp_path.rglob("v0*"))


# F10: figures in messages


def test_a_tiny_budget_cap_is_shown_with_its_digits():
    from conductor.policy.training import _target_text

    text = _target_text({"why": {"math": {"reached": False, "cap_usd": 1.2e-7, "usd": 3.4e-5}}})
    assert text == ["budget   math: NOT MET on train: no action costs at most $0.000000120; the fixed action is "
                    "the cheapest, $0.0000340"]


def test_show_says_when_the_estimates_cover_fewer_than_the_held_back_queries():
    from conductor.policy.training import _selection_text

    sel = {"learned": {"reward": 0.5, "reward_se": 0.1, "matched": 21}, "held_back_queries": 22,
           "fixed": {"reward": 0.4, "reward_se": 0.1, "matched": 22, "choice": {"math": "single:a"}}}
    assert _selection_text(sel).startswith("on 22 held-back queries (estimates over those whose logs hold its "
                                           "choice: learned 21): learned 0.5000 ± 0.1000")


def test_a_target_beyond_any_accuracy_is_refused():
    from conductor.errors import ConductorError
    from conductor.evaluation import Target

    for text in ("5:0.25", "-1.5:0.25"):
        with pytest.raises(ConductorError, match="from -1 to 1"):
            Target.parse(text)
    assert Target.parse("-1:0.5").accuracy_delta == -1


# F9: the evaluation's labels


def _policy(kind, name, acc, usd, info=None, ids=("a", "b", "c", "d"), queries=None):
    from conductor.evaluation.policies import Policy

    right = round(acc * len(ids))
    outcomes = {q: (i < right, usd) for i, q in enumerate(ids)}
    return Policy(kind, name, acc, None, usd, 1.0, 10.0, queries or len(ids), info=info or {}, graded=len(ids),
                  outcomes=outcomes)


def test_two_artifacts_at_one_lambda_each_get_their_comparison_row():
    from conductor.evaluation import comparisons
    from conductor.evaluation.report import comparison_table

    rows = []
    for v in (1, 2):
        info = {"lambda": 30.0, "floor": None, "budget": None, "artifact": f"/p/v000{v}", "version": v}
        rows += [_policy("learned", f"learned policy, λ 30 (table v000{v})", 0.5, 0.001, {**info, "shipped": False}),
                 _policy("fixed", f"best fixed action on train, λ 30 (v000{v})", 0.75, 0.002,
                         {**info, "shipped": True})]
    best = _policy("best_single", "best single", 0.75, 0.004, {"chosen_by": "grader"})
    out = comparisons([*rows, best])
    assert [r["version"] for r in out] == [1, 2]
    table = comparison_table(out)
    assert "| λ 30, v0001 | fixed |" in table and "| λ 30, v0002 | fixed |" in table


def test_a_target_under_planner_limit_is_judged_on_the_same_queries():
    from conductor.evaluation import Target, check_target
    from conductor.evaluation.report import target_lines

    everyone = _policy("best_single", "best single", 0.9, 0.01, {"chosen_by": "grader"},
                       ids=tuple("abcdefghij"))
    same = _policy("best_single", "best single", 0.5, 0.004, {"chosen_by": "grader"}, ids=("a", "b"))
    shipped = _policy("fixed", "fixed (2 of 10 queries)", 0.5, 0.001, {"shipped": True, "lambda": 30.0},
                      ids=("a", "b"))
    t = check_target(Target.parse("0:0.25"), [shipped, everyone], same)
    assert t["met"] and t["need_accuracy"] == pytest.approx(0.5) and t["queries"] == 2
    assert "the best single on the same 2 queries the policies ran on" in target_lines([t])[0]


def test_the_chart_labels_two_artifacts_at_one_lambda_with_their_versions(tmp_path):
    from conductor.evaluation.report import chart

    rows = []
    for v, usd in ((1, 0.001), (2, 0.0015)):
        info = {"lambda": 30.0, "floor": None, "budget": None, "artifact": f"/p/v000{v}", "version": v,
                "shipped": v == 2}
        rows += [_policy("learned", f"learned v{v}", 0.5, usd, info),
                 _policy("fixed", f"fixed v{v}", 0.75, usd * 2, info)]
    lone = {"lambda": 100.0, "floor": None, "budget": None, "artifact": "/p/v0003", "version": 3}
    rows += [_policy("learned", "learned v3", 0.25, 0.0005, lone),
             _policy("best_single", "best single", 0.75, 0.004, {"chosen_by": "grader"})]
    # SVG keeps every label's text in a comment beside its glyphs
    svg = chart(rows, tmp_path / "chart.svg", "t").read_text()
    for label in ("learned λ 30, v0001", "learned λ 30, v0002 (shipped)", "fixed λ 30, v0001",
                  "fixed λ 30, v0002 (shipped)", "learned λ 100"):  # λ 100: one artifact, no version
        assert f"<!-- {label} -->" in svg, label
