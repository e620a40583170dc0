"""`conductor export`: a run's K rollouts per query, written in the layouts TRL's GRPO
trainer and verl read, Parquet and JSONL holding the same rows, with rewards,
group advantages, propensities and costs that match what the pipeline logged."""

from __future__ import annotations

import math
import statistics

import orjson
import pyarrow.parquet as pq
import pytest

from conductor.errors import ConductorError
from conductor.export import TRL, VERL
from conductor.planners import prompt as prompts
from conductor.planners.base import Query
from conductor.pool import load_pool
from conductor.queries import load_queries
from conductor.runner import RunConfig, run_all
from tests.conftest import cli, run_cli, worker, write_pool

K = 4


@pytest.fixture(scope="module")
def rollout(tmp_path_factory, sim, sample_queries):
    """A real run: K=4 plans per query from the embedded planner against the simulated pool."""
    d = tmp_path_factory.mktemp("export")
    pool = write_pool(d / "pool.yaml", sim.url)
    summary = run_all(RunConfig(queries=sample_queries, pool=pool, data_dir=d / "data", run_id="roll",
                                samples=K, planner_options={"policy": "none", "explore": 0.3}, progress=False))
    assert summary["plans"] == 60 * K
    return d, pool, sample_queries


def _read_both(out):
    table = pq.read_table(out / "train.parquet")
    lines = [orjson.loads(x) for x in (out / "train.jsonl").read_bytes().splitlines()]
    return table, lines


def test_trl_layout_holds_prompt_completion_reward_and_matches_the_run(rollout):
    d, pool_path, queries = rollout
    out = d / "trl"
    r = run_cli("export", "--run", "roll", "--data-dir", d / "data", "--format", "trl", "--out", out)
    assert r.returncode == 0, r.stderr
    table, lines = _read_both(out)
    assert table.schema.equals(TRL)
    assert table.num_rows == len(lines) == 60 * K
    assert table.to_pylist() == lines  # Parquet and JSONL agree, row for row

    run = d / "data" / "runs" / "roll"
    rewards = {x["plan_id"]: x for x in pq.read_table(run / "rewards.parquet").to_pylist()}
    plans = {x["plan_id"]: x for x in pq.read_table(run / "plans.parquet").to_pylist()}
    pool = load_pool(pool_path)
    qs = {q["query_id"]: q for q in load_queries(queries).to_pylist()}
    for row in lines:
        # TRL's conversational prompt-completion format.
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
        assert row["completion"] == [{"role": "assistant", "content": plans[row["plan_id"]]["raw_text"]}]
        # The prompt is what an LLM conductor over this pool would be asked for this query.
        q = qs[row["query_id"]]
        assert row["prompt"] == prompts.messages(Query(q["query_id"], q["prompt"], q["task"]), pool, "structured", 5)
        assert orjson.loads(row["completion"][0]["content"])["steps"]
        logged = rewards[row["plan_id"]]
        assert row["reward"] == logged["reward"] and row["advantage"] == logged["advantage"]
        assert row["correct"] == logged["correct"] and row["reference"] == q["reference"]
        # The embedded planner logs a propensity, never a log-probability.
        assert row["logprob"] is None and 0 < row["propensity"] <= 1
        assert row["propensity"] == plans[row["plan_id"]]["propensity"]
        assert row["cost_usd"] >= 0

    # Advantages are GRPO's: per query, (r - mean) / (sample std + 1e-4) over the K plans.
    groups: dict[str, list[dict]] = {}
    for row in lines:
        groups.setdefault(row["query_id"], []).append(row)
    assert all(len(g) == K for g in groups.values())
    varied = 0
    for g in groups.values():
        rs = [x["reward"] for x in g]
        sd = statistics.stdev(rs)
        for x in g:
            assert x["advantage"] == pytest.approx((x["reward"] - statistics.fmean(rs)) / (sd + 1e-4))
        assert sum(x["advantage"] for x in g) == pytest.approx(0, abs=1e-9)
        varied += sd > 0
    assert varied > 5  # the groups hold real signal, not only ties


def test_verl_layout_has_one_row_per_query_with_its_rollouts(rollout):
    d, _, queries = rollout
    out = d / "verl"
    assert run_cli("export", "--run", "roll", "--data-dir", d / "data", "--format", "verl",
                   "--out", out).returncode == 0
    table, lines = _read_both(out)
    assert table.schema.equals(VERL)
    assert table.to_pylist() == lines and len(lines) == 60
    trl = {x["plan_id"]: x for x in pq.read_table(d / "trl" / "train.parquet").to_pylist()} \
        if (d / "trl").exists() else None
    rows = load_queries(queries).to_pylist()
    qs = {q["query_id"]: q for q in rows}
    index = {q["query_id"]: i for i, q in enumerate(rows)}
    for row in lines:
        q = qs[row["extra_info"]["query_id"]]
        assert row["data_source"] == "conductor/small"
        assert row["ability"] == q["task"]
        assert row["reward_model"] == {"style": "rule", "ground_truth": q["reference"]}
        assert row["prompt"][1]["role"] == "user" and q["prompt"] in row["prompt"][1]["content"]
        assert len(row["responses"]) == len(row["rewards"]) == len(row["advantages"]) == K
        assert len(row["propensities"]) == len(row["costs_usd"]) == len(row["plan_ids"]) == K
        assert row["extra_info"]["index"] == index[q["query_id"]] and row["extra_info"]["run_id"] == "roll"
        if trl is not None:  # the same rollouts as the per-plan layout
            for pid, resp, rew, adv in zip(row["plan_ids"], row["responses"], row["rewards"], row["advantages"]):
                assert trl[pid]["completion"][0]["content"] == resp
                assert (trl[pid]["reward"], trl[pid]["advantage"]) == (rew, adv)


def test_a_cost_penalty_prices_cache_hits_as_first_paid(tmp_path, sim, sample_queries):
    """A second round answered from the response cache pays $0, but its workflows cost what
    they cost: its rewards are the first round's, and export recomputes the same figures."""
    from conductor.export import export_run
    from conductor.rewards import RewardScheme

    pool = write_pool(tmp_path / "pool.yaml", sim.url)
    lam = 2000.0
    runs = {}
    for run_id in ("first", "cached"):
        summary = run_all(RunConfig(queries=sample_queries, pool=pool, data_dir=tmp_path / "data", run_id=run_id,
                                    samples=2, planner_options={"policy": "none"}, progress=False,
                                    rewards=RewardScheme(cost_penalty=lam)))
        runs[run_id] = {x["sample"] * 1000 + x["query_index"]: x for x in pq.read_table(
            tmp_path / "data" / "runs" / run_id / "rewards.parquet").to_pylist()}
    assert summary["cache_hits"] > 0 and summary["calls"] == 0 and summary["cost_usd"] == 0
    first, cached = runs["first"], runs["cached"]
    assert any(x["reward"] < 0.9 for x in first.values() if x["correct"])  # the penalty bites
    assert {k: x["reward"] for k, x in cached.items()} == pytest.approx({k: x["reward"] for k, x in first.items()})
    exported = export_run(tmp_path / "data", "cached", "trl", tmp_path / "out", cost_penalty=lam)
    by_plan = {x["plan_id"]: x["reward"] for x in pq.read_table(exported.parquet).to_pylist()}
    assert by_plan == pytest.approx({x["plan_id"]: x["reward"] for x in cached.values()})


def test_a_cost_penalty_rescales_rewards_and_recomputes_advantages(rollout, tmp_path):
    from conductor.export import export_run

    d, _, _ = rollout
    plain = export_run(d / "data", "roll", "trl", tmp_path / "plain")
    lam = 2000.0
    penalized = export_run(d / "data", "roll", "trl", tmp_path / "pen", cost_penalty=lam)
    a = {x["plan_id"]: x for x in pq.read_table(plain.parquet).to_pylist()}
    b = {x["plan_id"]: x for x in pq.read_table(penalized.parquet).to_pylist()}
    assert orjson.loads(penalized.meta.read_bytes())["reward"].endswith(f"minus {lam:g} x USD")
    changed = 0
    for pid, x in a.items():
        base = 1.0 if x["correct"] else (0.5 if x["parsed"] and x["status"] == "ok" else 0.0)
        assert b[pid]["reward"] == pytest.approx(base - lam * x["cost_usd"])
        changed += not math.isclose(b[pid]["advantage"], x["advantage"], abs_tol=1e-9)
    assert changed > 0  # cheaper plans now gain relative to their group
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConductorError, match="--cost-penalty must be a finite number, at least 0"):
            export_run(d / "data", "roll", "trl", tmp_path / "bad", cost_penalty=bad)
    assert not (tmp_path / "bad").exists()


def test_export_errors_name_what_is_wrong(rollout, tmp_path):
    d, _, _ = rollout
    r = cli("export", "--run", "nope", "--data-dir", d / "data", "--format", "trl", "--out", tmp_path / "x")
    assert r.returncode == 2 and "run nope: not found" in r.stderr
    r = cli("export", "--run", "roll", "--data-dir", d / "data", "--format", "csv", "--out", tmp_path / "x")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    assert not (tmp_path / "x").exists()
    r = cli("export", "--run", "roll", "--data-dir", d / "data", "--format", "trl", "--out", tmp_path / "y",
            "--pool", tmp_path / "missing.yaml")
    assert r.returncode == 2 and f"--pool {tmp_path / 'missing.yaml'}: not found" in r.stderr
    taken = tmp_path / "data.parquet"
    taken.write_bytes(b"not mine")
    r = cli("export", "--run", "roll", "--data-dir", d / "data", "--format", "trl", "--out", taken)
    assert r.returncode == 2 and f"--out {taken}: is a file; give a folder" in r.stderr
    assert taken.read_bytes() == b"not mine"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, sim, sample_queries):
    """A sweep whose tasks have candidate sets of different sizes: some queries leave slots unused."""
    from conductor.policy.actions import action_set

    def w(name, price, skills):
        return {**worker(name, sim.url), "price": {"input_per_mtok": price, "output_per_mtok": 2 * price},
                "skills": skills}

    d = tmp_path_factory.mktemp("sweep")
    pool_path = write_pool(d / "pool.yaml", sim.url, workers=[
        w("fast", 0.1, {"math": 0.9, "choice": 0.5}), w("weak", 0.1, {"math": 0.3}),
        w("flaky", 5.0, {"math": 0.95, "choice": 0.9}), {"id": "vote", "kind": "function"}])
    pool = load_pool(pool_path)
    tasks = set(load_queries(sample_queries).column("task").to_pylist())
    sizes = {t: len(action_set(pool, t)) for t in tasks}
    assert len(set(sizes.values())) > 1, sizes  # some task has fewer candidates than another
    summary = run_all(RunConfig(queries=sample_queries, pool=pool_path, data_dir=d / "data", run_id="sweep",
                                samples=max(sizes.values()), planner_options={"sweep": True, "policy": "none"},
                                progress=False))
    return d, summary


def test_a_sweeps_unused_slots_are_not_graded(sweep):
    """A sweep gives each query as many slots as the largest candidate set among the tasks;
    a query of a task with fewer candidates leaves slots unused. They are no wrong answers:
    ungraded, out of the accuracy and of the group advantages."""
    d, summary = sweep
    run = d / "data" / "runs" / "sweep"
    results = {r["plan_id"]: r for r in pq.read_table(run / "results.parquet").to_pylist()}
    rewards = pq.read_table(run / "rewards.parquet").to_pylist()
    unused = [r for r in rewards if (results[r["plan_id"]]["error"] or "").startswith("sweep slot not used")]
    assert unused and all(r["correct"] is None and r["reward"] is None and r["advantage"] is None for r in unused)
    graded = [r for r in rewards if r["correct"] is not None]
    assert summary["graded"] == len(graded) == len(rewards) - len(unused)
    assert summary["accuracy"] == pytest.approx(sum(r["correct"] for r in graded) / len(graded))


def test_a_sweeps_unused_slots_are_left_out_of_the_export(sweep):
    """Unused slots are no rollouts: a trainer must not read them as empty assistant turns."""
    d, _ = sweep
    rewards = pq.read_table(d / "data" / "runs" / "sweep" / "rewards.parquet").to_pylist()
    graded = {r["plan_id"]: r for r in rewards if r["correct"] is not None}
    n_unused = len(rewards) - len(graded)
    assert n_unused > 0

    r = run_cli("export", "--run", "sweep", "--data-dir", d / "data", "--format", "trl", "--out", d / "trl")
    assert r.returncode == 0, r.stderr
    assert f"{len(graded)} rows ({len(graded)} plans; {n_unused} unused sweep slots left out)" in r.stdout
    table, lines = _read_both(d / "trl")
    assert table.to_pylist() == lines
    assert sorted(x["plan_id"] for x in lines) == sorted(graded)
    assert all(x["completion"][0]["content"] and x["reward"] is not None for x in lines)
    meta = orjson.loads((d / "trl" / "export.json").read_bytes())
    assert (meta["rows"], meta["plans"], meta["unused_sweep_slots"]) == (len(graded), len(graded), n_unused)
    # The group advantages are over the rollouts exported, the group a trainer sees.
    groups: dict[str, list[dict]] = {}
    for x in lines:
        groups.setdefault(x["query_id"], []).append(x)
    for g in groups.values():
        rs = [x["reward"] for x in g]
        for x in g:
            assert x["advantage"] == pytest.approx(
                (x["reward"] - statistics.fmean(rs)) / (statistics.stdev(rs) + 1e-4) if len(g) > 1 else 0.0)

    r = run_cli("export", "--run", "sweep", "--data-dir", d / "data", "--format", "verl", "--out", d / "verl")
    assert r.returncode == 0, r.stderr
    _, verl = _read_both(d / "verl")
    assert len(verl) == len(groups)
    for row in verl:
        g = groups[row["extra_info"]["query_id"]]
        assert row["plan_ids"] == [x["plan_id"] for x in g]
        assert all(row["responses"]) and None not in row["rewards"] and None not in row["advantages"]
    assert orjson.loads((d / "verl" / "export.json").read_bytes())["unused_sweep_slots"] == n_unused


def test_export_refuses_a_pool_without_a_worker_the_run_used(rollout, tmp_path, sim):
    """The prompt lists the pool's workers: a completion routing to a worker it does not list
    is a pair no conductor LLM should learn from."""
    d, pool_path, _ = rollout
    used = {w for ws in pq.read_table(d / "data" / "runs" / "roll" / "plans.parquet").column("workers").to_pylist()
            for w in ws or ()}
    assert used == {"fast", "weak"}
    smaller = write_pool(tmp_path / "no-weak.yaml", sim.url, names=("fast",))
    r = cli("export", "--run", "roll", "--data-dir", d / "data", "--format", "trl", "--out", tmp_path / "x",
            "--pool", smaller)
    assert r.returncode == 2
    assert f"run roll: its plans route steps to weak, which pool {smaller} lacks" in r.stderr
    assert not (tmp_path / "x").exists()
    # A pool with every worker the run used (and more) is fine.
    larger = write_pool(tmp_path / "more.yaml", sim.url, names=("fast", "weak", "extra"))
    r = cli("export", "--run", "roll", "--data-dir", d / "data", "--format", "trl", "--out", tmp_path / "y",
            "--pool", larger)
    assert r.returncode == 0, r.stderr


KILL_AFTER_PARQUET = """
import os, signal, sys
from pathlib import Path
import conductor.export as ex

real = ex._write
def _write(path, write):
    if path.name == "train.jsonl":  # the new train.parquet is in place; die while writing train.jsonl
        write(path.with_name(f".{path.name}.{os.getpid()}.tmp"))
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, write)
ex._write = _write
ex.export_run(Path(sys.argv[1]), "roll", "verl", Path(sys.argv[2]))
"""


def test_a_killed_export_leaves_no_export_json_beside_files_not_its_own(rollout, tmp_path):
    """kill -9 while a verl export replaces a trl one: the folder must not offer the old
    export.json and train.jsonl beside the new train.parquet. export.json comes last."""
    import os
    import subprocess
    import sys

    d, _, _ = rollout
    out = tmp_path / "out"
    assert run_cli("export", "--run", "roll", "--data-dir", d / "data", "--format", "trl",
                   "--out", out).returncode == 0
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_PARQUET, str(d / "data"), str(out)],
                            env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert pq.read_table(out / "train.parquet").num_rows == 60  # the new (verl) one
    assert not (out / "export.json").exists() and not (out / "train.jsonl").exists()
    assert list(out.glob(".train.jsonl.*.tmp"))  # what the killed process was writing
    # Rerun: a complete, consistent set, and the killed process's temp file is gone.
    assert run_cli("export", "--run", "roll", "--data-dir", d / "data", "--format", "verl",
                   "--out", out).returncode == 0
    table, lines = _read_both(out)
    meta = orjson.loads((out / "export.json").read_bytes())
    assert meta["format"] == "verl" and meta["rows"] == table.num_rows == len(lines) == 60
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "train.jsonl", "train.parquet"]
