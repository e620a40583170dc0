"""audit80 F3 and F5: the pool loader refuses keys a worker of its kind ignores (as it refused `function`
on an llm worker and `model` on a function worker), and a model without a `/` is not said to have
a prefix when its worker lands on provider `default`."""

from __future__ import annotations

import re

import polars as pl
import pytest
import yaml

from conductor.cli import main as cli_main
from conductor.errors import PoolError
from conductor.pool import load_pool, parse_pool
from tests.conftest import REPO

LLM = {"id": "small", "model": "openai/small"}
PRICE = {"input_per_mtok": 1, "output_per_mtok": 2}


def write(tmp_path, *workers: dict, **top) -> str:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({**top, "workers": [LLM, *workers]}, sort_keys=False))
    return path


def test_function_on_a_planner_worker_is_refused_naming_file_worker_and_fix(tmp_path):
    """F3: `_replan` never reads it; it only changed the run id."""
    pool = write(tmp_path, {"id": "conductor", "kind": "planner", "function": "vote"})
    with pytest.raises(PoolError) as e:
        load_pool(pool)
    assert str(e.value) == (f"pool file {pool}: workers[1] (conductor).function: a worker of kind: planner ignores "
                            f"function (it plans and runs a new workflow for its step; function is only for a "
                            f"worker of kind: function); remove function")


@pytest.mark.parametrize("key, value", [("api_base", "http://127.0.0.1:9/v1"), ("price", PRICE),
                                        ("params", {"temperature": 0}), ("system", "Be brief."),
                                        ("context_tokens", 8000), ("max_call_usd", 0.01)])
def test_a_model_call_setting_on_a_function_worker_is_refused(tmp_path, key, value):
    """F3: a function step sends nothing and costs 0, so each of these was accepted and read by nothing."""
    pool = write(tmp_path, {"id": "vote", "kind": "function", key: value})
    with pytest.raises(PoolError) as e:
        load_pool(pool)
    assert str(e.value) == (f"pool file {pool}: workers[1] (vote).{key}: a worker of kind: function calls no "
                            f"model (its function runs locally, for free), so it ignores {key}; remove it")


def test_several_ignored_keys_are_named_together(tmp_path):
    pool = write(tmp_path, {"id": "vote", "kind": "function", "system": "hi", "api_base": "http://x/v1",
                            "price": PRICE, "params": {"temperature": 0}})
    with pytest.raises(PoolError, match=re.escape("workers[1] (vote).api_base: a worker of kind: function calls no "
                                                  "model (its function runs locally, for free), so it ignores "
                                                  "api_base, price, params and system; remove them")):
        load_pool(pool)


def test_null_and_an_empty_params_still_mean_the_default(tmp_path):
    """A key given as null takes its default (README), and `params: {}` is the default itself."""
    pool = load_pool(write(tmp_path, {"id": "vote", "kind": "function", "api_base": None, "price": None,
                                      "params": {}, "system": None, "context_tokens": None, "max_call_usd": None},
                           {"id": "conductor", "kind": "planner", "function": None}))
    vote, planner = pool.worker("vote"), pool.worker("conductor")
    assert (vote.function, vote.params, vote.price, vote.system, vote.api_base) == ("vote", {}, None, None, None)
    assert planner.function is None


def test_what_the_other_kinds_read_is_still_accepted(tmp_path):
    """A planner worker with a model is the LLM planner's own model: its endpoint, price, params and
    system are sent with its calls, so they stay allowed there, as `function` on a function worker."""
    pool = load_pool(write(tmp_path, {"id": "extract", "kind": "function", "function": "extract",
                                      "description": "the one answer", "skills": ["math"]},
                           {"id": "conductor", "kind": "planner", "model": "openai/sim-planner",
                            "api_base": "http://127.0.0.1:9/v1", "price": PRICE, "params": {"temperature": 0},
                            "system": "Plan."}))
    assert pool.worker("extract").function == "extract" and pool.worker("conductor").system == "Plan."


def test_the_shipped_pools_and_the_replay_pool_writer_carry_none_of_them(tmp_path):
    """Pools users got from this project still load: data/pools/ and what `conductor replay pool` writes
    (its vote and extract workers carry only id, kind, function and description)."""
    for path in sorted((REPO / "data" / "pools").glob("*.yaml")):
        load_pool(path)
    table, pool = tmp_path / "mine.parquet", tmp_path / "replay.yaml"
    pl.DataFrame([{"question_id": f"q{i}", "question": f"What is {i} + 1?", "reference": str(i + 1),
                   "model": model, "response": f"Answer: {i + 1}", "correct": True}
                  for i in range(4) for model in ("m1", "m2")]).write_parquet(table)
    prices = tmp_path / "prices.csv"
    prices.write_text("model,input_usd_per_mtok,output_usd_per_mtok\nm1,0.1,0.2\nm2,1,2\n")
    (tmp_path / "replay-dir").mkdir()
    assert cli_main(["replay", "pool", "--table", str(table), "--task", "math", "--prices", str(prices),
                     "--replay-dir", str(tmp_path / "replay-dir"), "--out", str(pool)]) == 0
    functions = [w for w in load_pool(pool).workers if w.kind == "function"]
    assert [w.id for w in functions] == ["vote", "extract"]
    raw = {w["id"]: w for w in yaml.safe_load(pool.read_text())["workers"]}
    assert [sorted(raw[w.id]) for w in functions] == [["description", "function", "id", "kind"]] * 2


def test_a_model_without_a_prefix_is_not_said_to_have_one(tmp_path):
    """F5: `gpt-4o` has no prefix; its worker lands on provider `default`, and the message said
    "(its model's prefix)"."""
    pool = tmp_path / "pool.yaml"
    pool.write_text("providers: {sim: {}}\nworkers:\n  - {id: w, model: gpt-4o}\n")
    with pytest.raises(PoolError) as e:
        load_pool(pool)
    assert str(e.value) == (f"pool file {pool}: workers[0] (w).provider: required, since the file has providers: "
                            f"(sim); without it the worker would run on provider 'default' (its model 'gpt-4o' has "
                            f"no provider prefix), which is not listed: default limits and no budget. Name one of "
                            f"them, or list `default: {{}}` to allow that")


def test_a_prefixed_model_is_still_said_to_give_its_prefix():
    with pytest.raises(PoolError) as e:
        parse_pool({"providers": {"sim": {}}, "workers": [{"id": "w", "model": "anthropic/claude"}]})
    assert "would run on provider 'anthropic' (its model's prefix), which is not listed" in str(e.value)


@pytest.mark.parametrize("price", [{"input_per_mtok": 0, "output_per_mtok": 0},
                                   {"input_per_token": 0.0, "output_per_token": 0}])
def test_a_price_of_zero_on_a_function_worker_is_still_taken(tmp_path, price):
    """It says what is so (a function costs nothing), and pools that wrote it keep their run ids and
    policies by loading as before (review43 3); any other price is refused above."""
    vote = load_pool(write(tmp_path, {"id": "vote", "kind": "function", "price": price})).worker("vote")
    assert (vote.price.input, vote.price.output) == (0, 0)
