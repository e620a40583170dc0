"""Findings of audit73 (F4, F6, F7, F9): what a user reads of a run's cost when a price is
unknown, and of a pool file whose skills, variables, ids, version or nulls are not what they meant."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from conductor.errors import PoolError
from conductor.pool import load_pool
from tests.conftest import cli, first_queries, worker, write_pool


def _pool(tmp_path, text: str):
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    return path


# ---- F4: the cost of a run with plans of unknown price ---------------------------------------

def test_a_run_with_an_unpriced_step_in_every_plan_shows_the_priced_calls_as_a_lower_bound(
        tmp_path, tmp_path_factory, sample_queries, fresh_sim):
    """F4: each plan held one call to a worker with no price; its summary said $0.000000 total,
    though the other worker's calls had been paid: not even a lower bound."""
    queries = first_queries(tmp_path_factory, sample_queries, 8)
    fast = worker("fast", fresh_sim.url)
    del fast["price"]  # openai/fast: not in litellm's cost map either
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, workers=[fast, worker("weak", fresh_sim.url)])
    data = tmp_path / "data"
    r = cli("run", queries, "--pool", pool, "--data-dir", data, "--quiet",
            "--planner-option", "templates=verify")  # each plan: one solves, the other checks
    assert r.returncode == 0, r.stdout + r.stderr
    run = next((data / "runs").iterdir())
    traces = pq.read_table(run / "traces.parquet", columns=["worker", "cost_usd"]).to_pylist()
    paid = sum(t["cost_usd"] for t in traces if t["cost_usd"] is not None)
    assert paid > 0 and any(t["worker"] == "fast" and t["cost_usd"] is None for t in traces)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["plans_without_price"] == 8
    assert summary["cost_usd"] == pytest.approx(paid)  # the priced calls, as the budgets charged them
    spend = {c["cap"]: c["spent_usd"] for c in json.loads((run / "manifest.json").read_text())["spend"]}
    assert summary["cost_usd"] == pytest.approx(spend["run"], abs=1e-6)  # README: equal, none lost in flight
    cost = next(line for line in r.stdout.splitlines() if line.startswith("cost"))
    assert cost.split(None, 1)[1] == (f"at least ${paid:.6f} total, at least ${paid / 8:.6f} per query  "
                                      f"(8 plan(s) with unknown price: only their priced calls are counted)")


# ---- F6: skill tags --------------------------------------------------------------------------

def test_a_skill_tag_that_is_no_task_is_refused_naming_the_tasks(tmp_path):
    """F6: `maths` was accepted, and the planner silently used its default skill for math."""
    pool = _pool(tmp_path, "workers:\n  - {id: small, model: openai/s, skills: {maths: 0.99, choice: 0.5}}\n")
    with pytest.raises(PoolError) as e:
        load_pool(pool)
    assert str(e.value) == (f"pool file {pool}: workers[0] (small).skills.maths: not a task (did you mean "
                            f"'math'?); a skill is read for a query's task: one of math, choice, exact, literal, "
                            f"code, record, or default (for a task the worker lists no skill for)")
    pool.write_text("workers:\n  - {id: small, model: openai/s, skills: [math, finance]}\n")  # tags alike
    with pytest.raises(PoolError, match=r"workers\[0\] \(small\)\.skills\.finance: not a task; a skill is read"):
        load_pool(pool)
    pool.write_text("workers:\n  - {id: small, model: openai/s, skills: {math: 0.8, default: 0.4, record: 0.3}}\n")
    small = load_pool(pool).worker("small")
    assert small.skill("math") == 0.8 and small.skill("code") == 0.4


def test_a_misspelled_skill_stops_the_run_before_its_folder(tmp_path, sample_queries):
    pool = _pool(tmp_path, "workers:\n  - {id: small, model: openai/s, api_base: 'http://127.0.0.1:9/v1', "
                           "price: {input_per_mtok: 1, output_per_mtok: 2}, skills: {Math: 0.9}}\n")
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 2
    assert "workers[0] (small).skills.Math: not a task (did you mean 'math'?)" in r.stderr, r.stderr
    assert not (tmp_path / "data" / "runs").exists()


# ---- F7: ${VAR:-default} as the shell reads it -----------------------------------------------

def test_a_variable_set_empty_takes_the_default(tmp_path, monkeypatch):
    """F7: `export URL=` (as .env templates leave it) gave `api_base: must start with http:// (got '')`."""
    monkeypatch.setenv("AUDIT73_EMPTY", "")
    pool = _pool(tmp_path, "workers:\n  - {id: w, model: openai/m, api_base: '${AUDIT73_EMPTY:-http://127.0.0.1:9/v1}'}\n")
    assert load_pool(pool).worker("w").api_base == "http://127.0.0.1:9/v1"
    monkeypatch.setenv("AUDIT73_EMPTY", "http://127.0.0.1:8/v1")  # set: its value
    assert load_pool(pool).worker("w").api_base == "http://127.0.0.1:8/v1"


def test_a_default_may_hold_another_variable(tmp_path, monkeypatch):
    """F7: `${A:-${B}}` came out as `${B}` literally."""
    monkeypatch.delenv("AUDIT73_A", raising=False)
    monkeypatch.setenv("AUDIT73_B", "http://127.0.0.1:7/v1")
    pool = _pool(tmp_path, "workers:\n  - {id: w, model: openai/m, api_base: '${AUDIT73_A:-${AUDIT73_B}}'}\n")
    assert load_pool(pool).worker("w").api_base == "http://127.0.0.1:7/v1"
    pool.write_text("workers:\n  - {id: w, model: openai/m, "
                    "api_base: 'http://${AUDIT73_A:-${AUDIT73_C:-127.0.0.1}:6}/v1'}\n")
    assert load_pool(pool).worker("w").api_base == "http://127.0.0.1:6/v1"
    monkeypatch.setenv("AUDIT73_A", "http://127.0.0.1:5/v1")  # the outer one set: the default is not read
    pool.write_text("workers:\n  - {id: w, model: openai/m, api_base: '${AUDIT73_A:-${AUDIT73_UNSET_C}}'}\n")
    assert load_pool(pool).worker("w").api_base == "http://127.0.0.1:5/v1"
    monkeypatch.delenv("AUDIT73_A")
    with pytest.raises(PoolError, match=r"api_base: environment variable AUDIT73_UNSET_C is not set and has no default"):
        load_pool(pool)


def test_an_unclosed_default_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("AUDIT73_A", raising=False)
    pool = _pool(tmp_path, "workers:\n  - {id: w, model: openai/m, api_base: '${AUDIT73_A:-${AUDIT73_B}'}\n")
    with pytest.raises(PoolError, match=r"workers\[0\] \(w\)\.api_base: \$\{AUDIT73_A:-\.\.\.\} has no closing \}"):
        load_pool(pool)


# ---- F9: messages and nulls ------------------------------------------------------------------

def test_a_duplicate_id_names_both_positions(tmp_path):
    pool = _pool(tmp_path, "workers:\n  - {id: small, model: openai/s}\n  - {id: vote, kind: function}\n"
                           "  - {id: small, model: openai/t}\n")
    with pytest.raises(PoolError) as e:
        load_pool(pool)
    assert str(e.value).endswith("workers[2].id: duplicate worker id 'small' (also workers[0])")


def test_a_quoted_version_says_it_must_be_a_number(tmp_path):
    pool = _pool(tmp_path, "version: '1'\nworkers:\n  - {id: vote, kind: function}\n")
    with pytest.raises(PoolError) as e:
        load_pool(pool)
    assert str(e.value) == (f"pool file {pool}: version: this conductor reads pool files of version 1 "
                            f"(got '1': text, not a number; write version: 1 without quotes)")
    pool.write_text("version: 2\nworkers:\n  - {id: vote, kind: function}\n")
    with pytest.raises(PoolError, match=r"version: this conductor reads pool files of version 1 \(got 2\)$"):
        load_pool(pool)


def test_null_takes_the_default_for_batch_options_kind_description_and_version(tmp_path):
    """F9: `batch_poll_s: null` on an online provider, a worker's `kind: null` and `description: null`
    were refused, while the README says null takes the default (and `skills: null` was accepted)."""
    pool = _pool(tmp_path, "version: null\nproviders:\n  sim: {batch_poll_s: null, batch_retry: null, rpm: null}\n"
                           "workers:\n  - {id: w, provider: sim, model: openai/m, kind: null, description: null}\n")
    loaded = load_pool(pool)
    w, sim = loaded.worker("w"), loaded.providers["sim"]
    assert (w.kind, w.description, sim.mode, sim.batch_poll_s) == ("llm", "", "online", 30.0)
    pool.write_text("providers:\n  sim: {batch_poll_s: 5}\nworkers:\n  - {id: w, provider: sim, model: openai/m}\n")
    with pytest.raises(PoolError, match=r"providers\.sim\.batch_poll_s: only applies with mode: batch"):
        load_pool(pool)  # a value given still needs mode: batch
