"""Audit 62 on the learned policy: a policy.json whose `shipped`, λ, floor or budget disagrees with
what training recorded in the same file is refused by name; a sweep short of samples names the
count it needs (the largest candidate set) and the query that has it; `--policy ROOT` holding only
another pool's artifact names both pool keys. Small runs over the simulated pool, trained with
the table learner in a fraction of a second, and a replay pool over a few shared-table questions."""

from __future__ import annotations

import shutil

import orjson
import polars as pl
import pyarrow.parquet as pq
import pytest

from conductor import runner
from conductor.errors import ConductorError
from conductor.planners.base import Query
from conductor.planners.embedded import EmbeddedConfig, EmbeddedPlanner
from conductor.policy import artifact
from conductor.pool import load_pool
from conductor.runner import RunConfig
from tests.conftest import REPLAY, cli
from tests.test_policy_inputs import logged as base  # noqa: F401 - a fixture, by its name


@pytest.fixture(scope="module")
def logged(base):
    """test_policy_inputs' run and pools, and artifacts trained on the run: by λ, by a floor, by a budget."""
    roots = {}
    for name, extra in (("lam", ("--lambda", "30")), ("floor", ("--floor", "0")), ("budget", ("--budget", "0.5"))):
        roots[name] = base["dir"] / f"pol-{name}"
        r = cli("policy", "train", "--pool", base["pool"], "--runs", "explore", "--data-dir", base["data"],
                "--out", roots[name], "--learner", "table", *extra)
        assert r.returncode == 0, r.stderr
    return {**base, "roots": roots}


def _folder(logged, name):
    return artifact.find(load_pool(logged["pool"]), logged["roots"][name])


def edited_copy(folder, copy, edit):
    """A copy of the artifact `folder` at `copy`, its policy.json changed by `edit` (a user's edit)."""
    shutil.copytree(folder, copy)
    meta = orjson.loads((copy / "policy.json").read_bytes())
    edit(meta)
    (copy / "policy.json").write_bytes(orjson.dumps(meta))
    return copy


def _edited(logged, name, tmp_path, edit):
    return edited_copy(_folder(logged, name), tmp_path / f"edited-{name}", edit)


def _refused_everywhere(logged, folder, tmp_path, said):
    """`policy show`, `policy eval` and planning (`run`) all refuse it, naming the file and field."""
    r = cli("policy", "show", "--pool", logged["pool"], "--policy", folder)
    assert r.returncode == 2 and f"policy {folder / 'policy.json'}: " in r.stderr and said in r.stderr, \
        r.stdout + r.stderr
    for args in (("policy", "eval", "--pool", logged["pool"], "--queries", logged["queries"], "--policies", folder,
                  "--out", tmp_path / "eval", "--no-planner"),
                 ("run", logged["queries"], "--pool", logged["pool"], "--planner-option", f"policy={folder}",
                  "--run-id", "edited", "--data-dir", tmp_path / "data", "--quiet")):
        r = cli(*args)
        assert r.returncode == 2 and said in r.stderr, (args[:2], r.stdout + r.stderr)
    assert not (tmp_path / "data" / "runs").exists()


# F1: an edited `shipped`, λ, floor or budget is refused by name


def test_an_edited_shipped_is_refused_naming_what_training_chose(logged, tmp_path):
    for name in ("lam", "floor", "budget"):  # as trained now, each objective's artifact is accepted
        r = cli("policy", "show", "--pool", logged["pool"], "--policy", logged["roots"][name])
        assert r.returncode == 0 and "ships    " in r.stdout, (name, r.stderr)
    chose = orjson.loads((_folder(logged, "lam") / "policy.json").read_bytes())["training"]["selection"]["shipped"]
    flipped = "fixed" if chose == "learned" else "learned"

    def edit(m):
        m["shipped"] = flipped

    folder = _edited(logged, "lam", tmp_path, edit)
    _refused_everywhere(logged, folder, tmp_path,
                        f"field shipped is '{flipped}', expected '{chose}', the choice training recorded "
                        f"(training.selection.shipped)")


@pytest.mark.parametrize("name,field,value", [("lam", "lambda", 10.0), ("floor", "floor", -0.01),
                                              ("budget", "budget", 0.9), ("lam", "floor", 0.0)],
                         ids=["lambda", "floor", "budget", "floor-added"])
def test_an_edited_lambda_floor_or_budget_is_refused_naming_what_training_recorded(logged, tmp_path, name, field,
                                                                                  value):
    recorded = orjson.loads((_folder(logged, name) / "policy.json").read_bytes())["training"][field]
    assert recorded != value

    def edit(m):
        m[field] = value

    folder = _edited(logged, name, tmp_path, edit)
    _refused_everywhere(logged, folder, tmp_path,
                        f"field {field} is {value!r}, expected {recorded!r}, the value training recorded "
                        f"(training.{field})")


def test_an_older_training_summary_without_the_records_is_still_accepted(logged, tmp_path):
    """The first format-2 artifacts recorded neither λ, floor nor budget under `training`: there is
    nothing to compare, and they plan as before; the edited λ is still refused once recorded."""
    def edit(m):
        for k in ("lambda", "floor", "budget", "floor_lambda"):
            m["training"].pop(k, None)

    folder = _edited(logged, "lam", tmp_path, edit)
    r = cli("policy", "show", "--pool", logged["pool"], "--policy", folder)
    assert r.returncode == 0 and "lambda 30" in r.stdout, r.stderr
    drafts = EmbeddedPlanner(EmbeddedConfig(policy=str(folder))).plan(
        [Query("q", "What is 2 + 2?", "math")], load_pool(logged["pool"]), 1)[0]
    assert drafts[0].info["policy"].startswith("learned")
    # ... and the same file with the record in place but λ edited is refused (the check is live).
    meta = orjson.loads((folder / "policy.json").read_bytes())
    meta["training"]["lambda"], meta["lambda"] = 30.0, 10.0
    (folder / "policy.json").write_bytes(orjson.dumps(meta))
    with pytest.raises(ConductorError, match=r"field lambda is 10\.0, expected 30\.0"):
        artifact.load(folder, load_pool(logged["pool"]))


# F4: --policy ROOT holding only another pool's artifact


def test_a_root_holding_only_another_pools_artifact_names_both_keys(logged, tmp_path):
    root = logged["roots"]["lam"]
    keys = [artifact.pool_key(load_pool(p)) for p in (logged["pool"], logged["other"])]
    for args in (("policy", "show", "--pool", logged["other"], "--policy", root),
                 ("policy", "rollouts", logged["queries"], "--pool", logged["other"], "-k", "2", "--policy", root,
                  "--run-id", "r", "--data-dir", tmp_path / "data", "--quiet"),
                 ("policy", "eval", "--pool", logged["other"], "--queries", logged["queries"], "--policies", root,
                  "--out", tmp_path / "eval", "--no-planner"),
                 ("run", logged["queries"], "--pool", logged["other"], "--planner-option", f"policy={root}",
                  "--run-id", "p", "--data-dir", tmp_path / "data", "--quiet")):
        r = cli(*args)
        assert r.returncode == 2, (args[:2], r.stdout + r.stderr)
        assert "no version folder" not in r.stderr, r.stderr
        assert f"policy {root} holds artifacts only for other pools: pool {keys[0]} ({logged['pool']}" in r.stderr
        assert f"not this pool ({keys[1]}, {logged['other']})" in r.stderr, r.stderr
    assert not (tmp_path / "data" / "runs").exists()
    # A folder with nothing in it says so, as before; the root still serves its own pool.
    (tmp_path / "empty").mkdir()
    r = cli("policy", "show", "--pool", logged["other"], "--policy", tmp_path / "empty")
    assert r.returncode == 2 and "no version folder under it" in r.stderr
    assert cli("policy", "show", "--pool", logged["pool"], "--policy", root).returncode == 0


# F2: a sweep short of samples names the count it needs


@pytest.mark.slow
@pytest.mark.skipif(not (REPLAY / "gsm8k.parquet").is_file(), reason=f"shared replay data not found at {REPLAY}")
def test_a_short_sweep_names_the_largest_candidate_set_and_its_query(tmp_path):
    """The queries listed first lack one model's responses, so they have fewer candidates than the
    later ones: the count the message asks for must be the later ones', and asking for it works."""
    models = ["gpt-4o-2024-08-06", "gpt-4o-mini-2024-07-18", "gemma-2-2b-it", "Meta-Llama-3.1-8B-Instruct",
              "gemini-1.5-flash"]
    g = pl.read_parquet(REPLAY / "gsm8k.parquet").filter(pl.col("model").is_in(models))
    qs = g.select("question_id").unique().sort("question_id").head(6)["question_id"].to_list()
    g = g.filter(pl.col("question_id").is_in(qs))
    g = g.filter(~((pl.col("model") == models[1]) & pl.col("question_id").is_in(qs[:3])))
    g.write_parquet(tmp_path / "t.parquet")
    pool_file, queries = tmp_path / "pool.yaml", tmp_path / "q.parquet"
    for args in (("replay", "queries", "--table", tmp_path / "t.parquet", "--task", "math", "--split", "all",
                  "--out", queries),
                 ("replay", "pool", "--table", tmp_path / "t.parquet", "--task", "math", "--out", pool_file,
                  "--api-base", "http://127.0.0.1:9451/v1")):
        r = cli(*args)
        assert r.returncode == 0, r.stderr
    pool = load_pool(pool_file)
    rows = pq.read_table(queries).to_pylist()
    planner = runner.configured_planner(RunConfig(queries=queries, pool=pool_file, samples=4096,
                                                  planner_options={"sweep": True, "policy": "none"}), pool)
    planned = planner.plan([Query(index=i, **r) for i, r in enumerate(rows)], runner.planning_pool(pool), 4096)
    sizes = [d[0].info["candidates"] for d in planned]
    need = max(sizes)
    largest = rows[sizes.index(need)]["query_id"]
    assert min(sizes) < need and sizes[0] < need  # the first query is short of the largest set

    def refused(samples: int):
        cfg = RunConfig(queries=queries, pool=pool_file, samples=samples, data_dir=tmp_path / "data",
                        planner_options={"sweep": True, "policy": "none"})
        try:
            runner.configured_planner(cfg, pool)
        except ConductorError as e:
            return str(e)
        return None

    for samples in (1, sizes[0], need - 1):
        said = refused(samples)
        assert said is not None and f"query {largest} has {need} candidate actions but only {samples}" in said
        assert f"--samples {need} or more with `conductor run`" in said
    assert refused(need) is None  # following the advice works
    # Planning a batch directly names the same query and count.
    with pytest.raises(ConductorError, match=f"query {largest} has {need} candidate actions but only {sizes[0]}"):
        planner.plan([Query(index=i, **r) for i, r in enumerate(rows)], runner.planning_pool(pool), sizes[0])
    r = cli("run", queries, "--pool", pool_file, "-k", sizes[0], "--planner-option", "sweep=true",
            "--run-id", "short", "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 2 and f"--samples {need} or more" in r.stderr and not (tmp_path / "data" / "runs").exists()
