"""audit73: `--seed` reaches the embedded planner (F1), a worker priced by litellm's cost map is not
planned as free (F2), and a `max_steps` planner option other than --max-steps is refused (F3)."""

from __future__ import annotations

import collections
import hashlib
import os
import re

import orjson
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import REPO, SAMPLE, run_cli, serving
from tests.plannersim import math_queries

SERVED = {  # the models this module's simulated server answers as
    "fast": {"skill": 0.9, "latency_ms": {"mean": 2, "sd": 1}},
    "weak": {"skill": 0.6, "latency_ms": {"mean": 2, "sd": 1}},
    "gpt-4o": {"skill": 0.9, "latency_ms": {"mean": 2, "sd": 1}},  # a name litellm's cost map prices
    "sim-planner": {"role": "planner", "latency_ms": {"mean": 2, "sd": 1}},
}


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("sim73"), SERVED) as handle:
        yield handle


@pytest.fixture
def fresh(sim):
    sim.reset()
    return sim


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    return math_queries(tmp_path_factory.mktemp("q73") / "q8.parquet", 8)


def llm(wid: str, model: str, url: str, skill: float, price: tuple[float, float] | None = None) -> dict:
    w = {"id": wid, "model": f"openai/{model}", "provider": "sim", "api_base": url, "skills": {"default": skill},
         "params": {"temperature": 0, "max_tokens": 256}}
    if price is not None:
        w["price"] = {"input_per_mtok": price[0], "output_per_mtok": price[1]}
    return w


def pool_file(path, *workers: dict, providers: dict | None = None):
    path.write_text(yaml.safe_dump({"providers": providers or {"sim": {"max_concurrency": 16, "timeout_s": 10}},
                                    "workers": list(workers)}, sort_keys=False))
    return path


def plans_of(data, run_id: str) -> list[dict]:
    t = pq.read_table(data / "runs" / run_id / "plans.parquet")
    return t.sort_by([("query_index", "ascending"), ("sample", "ascending")]).to_pylist()


def actions(plans: list[dict]) -> list[str]:
    return [orjson.loads(p["info_json"])["action"] if p["valid"] else "invalid" for p in plans]


def _run_id(r) -> str:
    found = re.findall(r"\b([a-z0-9]+-[0-9a-f]{10})\b", r.stdout + r.stderr)
    assert found, (r.stdout, r.stderr)
    return found[0]


# ---- F1: --seed reaches the embedded planner -------------------------------------------------------------

def test_another_seed_draws_other_embedded_plans_and_the_seed_option_still_wins(fresh, tmp_path, q8):
    """Seeds 0 and 1 drew the same K=4 samples under two run ids: RL rollouts with seeds 1, 2, 3 were one
    sample paid for three times."""
    pool = pool_file(tmp_path / "pool.yaml", llm("a", "fast", fresh.url, 0.8, (1, 2)),
                     llm("b", "weak", fresh.url, 0.8, (1, 2)))
    data = tmp_path / "data"
    common = ["run", q8, "--pool", pool, "--data-dir", data, "--samples", "4", "--quiet", "--no-cache",
              "--planner-option", "templates=single", "--planner-option", "policy=none"]
    drawn = {}
    for name, extra in (("seed0", ["--seed", "0"]), ("seed1", ["--seed", "1"]),
                        ("seed1-option0", ["--seed", "1", "--planner-option", "seed=0"])):
        r = run_cli(*common, *extra)
        assert r.returncode == 0, r.stderr
        drawn[name] = (_run_id(r), actions(plans_of(data, _run_id(r))))
    assert len({rid for rid, _ in drawn.values()}) == 3
    assert set(drawn["seed0"][1]) == {"single:a", "single:b"}  # equal workers: each draw is a coin toss
    assert drawn["seed1"][1] != drawn["seed0"][1]
    assert drawn["seed1-option0"][1] == drawn["seed0"][1]  # --planner-option seed=N is the planner's seed


# Planned by HEAD 9b5842f (before this fix) from the committed data/queries/factual.parquet with the pool
# below, K=4, --seed 0: its run id and a digest of its plans. A seed 0 run keeps both.
HEAD_SEED0_RUN_ID = "factual-06b32bbcd8"
HEAD_SEED0_PLANS = "62bbd2c7293c15b9"
HEAD_SEED0_ACTIONS = {"ensemble:a+b+c>vote": 94, "single:a": 20, "single:b": 20, "single:c": 21, "verify:a>b": 42,
                      "verify:a>c": 47, "verify:b>a": 37, "verify:b>c": 44, "verify:c>a": 38, "verify:c>b": 37}
UNSET = "CONDUCTOR_TEST_UNSET_KEY_73"


def _fixed_pool(path):
    """Endpoints that are never called: the provider's key variable is unset, so the run stops at the
    check after planning (exit 2, plans saved, no worker called); its id depends on nothing of this host."""
    url = "http://127.0.0.1:1/v1"
    price = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}
    workers = [{"id": wid, "model": f"openai/{m}", "provider": "sim", "api_base": url, "skills": {"default": s},
                "price": price if wid != "c" else {"input_per_mtok": 0.5, "output_per_mtok": 1.0}}
               for wid, m, s in (("a", "fast", 0.8), ("b", "flaky", 0.8), ("c", "weak", 0.79))]
    workers.append({"id": "vote", "kind": "function", "function": "vote"})
    path.write_text(yaml.safe_dump({"providers": {"sim": {"api_key_env": UNSET}}, "workers": workers},
                                   sort_keys=False))
    return path


def _digest(plans: list[dict]) -> str:
    text = "|".join(f"{p['query_id']}#{p['sample']}:{p['steps_json']}:{p['propensity']!r}" for p in plans)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_seed_0_keeps_its_plans_and_run_id_and_seed_1_changes_the_plans(tmp_path):
    pool = _fixed_pool(tmp_path / "pool.yaml")
    env = {k: v for k, v in os.environ.items() if k != UNSET}
    env["CONDUCTOR_POLICY_DIR"] = str(tmp_path / "no-policies")  # the prior plans, as it did for the fixture
    got = {}
    for seed in ("0", "1"):
        data = tmp_path / f"data{seed}"
        r = run_cli("run", REPO / "data/queries/factual.parquet", "--pool", pool, "--data-dir", data,
                    "--samples", "4", "--seed", seed, "--quiet", env=env)
        assert r.returncode == 2 and f"{UNSET} is not set" in r.stderr and "no worker was called" in r.stderr
        rid = _run_id(r)
        got[seed] = (rid, plans_of(data, rid))
    rid, plans = got["0"]
    assert rid == HEAD_SEED0_RUN_ID
    assert dict(collections.Counter(actions(plans))) == HEAD_SEED0_ACTIONS
    assert _digest(plans) == HEAD_SEED0_PLANS
    assert _digest(got["1"][1]) != HEAD_SEED0_PLANS


def test_the_vllm_planner_takes_the_runs_seed_unless_its_option_is_given(tmp_path):
    """Its engine's seed (and each request's, with per_request_seed) was 0 whatever --seed said. No engine
    is loaded here: the seed the planner would give vllm.LLM is read off it."""
    from conductor.planners.vllm import VLLMPlanner, VLLMPlannerConfig
    from conductor.runner import RunConfig, configured_planner

    cfg = RunConfig(queries=SAMPLE, pool=REPO / "data/pools/sim.yaml", data_dir=tmp_path, planner="vllm",
                    planner_options={"model": "org/some-model"}, seed=5)
    assert configured_planner(cfg).seed == 5
    cfg.planner_options = {"model": "org/some-model", "seed": 2}
    assert configured_planner(cfg).seed == 2
    planner = VLLMPlanner(VLLMPlannerConfig(model="org/some-model"))
    planner.bind(seed=9)  # as the runner binds a planner given to run_all
    assert planner.seed == 9 and planner.config.seed == 9  # re-planning copies the config


# ---- F2: prices from litellm's cost map ------------------------------------------------------------------

def test_a_worker_priced_by_litellms_cost_map_is_not_planned_as_free(fresh, tmp_path, q8):
    """`price:` is optional (else litellm's cost map), and the executor bills gpt-4o at its map price; the
    embedded planner counted it $0 and sent every query to it instead of the cheap worker as good."""
    pool = pool_file(tmp_path / "pool.yaml", llm("small", "fast", fresh.url, 0.8, (0.15, 0.6)),
                     llm("gpt4o", "gpt-4o", fresh.url, 0.8))
    data = tmp_path / "data"
    r = run_cli("run", q8, "--pool", pool, "--data-dir", data, "--quiet", "--no-cache",
                "--planner-option", "templates=single", "--planner-option", "policy=none")
    assert r.returncode == 0, r.stderr
    plans = plans_of(data, _run_id(r))
    assert actions(plans) == ["single:small"] * 8
    assert fresh.log()["by_model"] == {"fast": 8}


def test_a_worker_of_no_known_price_counts_as_the_dearest_known_price(fresh, tmp_path, q8):
    """No pool price and no cost-map entry: counted at the dearest known price of the pool, not $0, so a
    slightly less skilled unknown does not win over a priced worker on price alone."""
    pool = pool_file(tmp_path / "pool.yaml", llm("mystery", "weak", fresh.url, 0.79),
                     llm("small", "fast", fresh.url, 0.8, (5, 20)))
    data = tmp_path / "data"
    r = run_cli("run", q8, "--pool", pool, "--data-dir", data, "--quiet", "--no-cache",
                "--planner-option", "templates=single", "--planner-option", "policy=none")
    assert r.returncode == 0, r.stderr
    assert actions(plans_of(data, _run_id(r))) == ["single:small"] * 8
    # and the user is told, with the way to say a local model is free (review41b 2)
    assert ("mystery: no price in the pool file nor in litellm's cost map; the embedded planner counts it at "
            "the dearest known price" in r.stderr and "input_per_mtok: 0, output_per_mtok: 0" in r.stderr), r.stderr


def test_the_policys_action_set_cascades_to_a_worker_priced_by_the_cost_map(fresh, tmp_path, q8):
    """The action set's cheap workers are those costing at most a third of the most skilled one: with
    gpt-4o counted $0, no worker was cheap, and a sweep measured no cascade at all."""
    pool = pool_file(tmp_path / "pool.yaml", llm("gpt4o", "gpt-4o", fresh.url, 0.9),
                     llm("x", "fast", fresh.url, 0.7, (0.1, 0.4)), llm("y", "weak", fresh.url, 0.6, (0.1, 0.4)),
                     {"id": "vote", "kind": "function", "function": "vote"})
    data = tmp_path / "data"
    queries = tmp_path / "q2.parquet"
    pq.write_table(pq.read_table(q8).slice(0, 2), queries)
    r = run_cli("run", queries, "--pool", pool, "--data-dir", data, "--quiet", "--no-cache", "--samples", "7",
                "--planner-option", "sweep=true", "--planner-option", "policy=none")
    assert r.returncode == 0, r.stderr
    assert actions(plans_of(data, _run_id(r)))[:7] == ["single:gpt4o", "single:x", "single:y", "cascade:x+y>gpt4o",
                                                       "verify:x>gpt4o", "verify:y>gpt4o", "verify:y>x"]


def test_the_llm_planners_cascade_example_escalates_to_the_dearest_worker_by_the_cost_map(fresh, tmp_path, q8):
    """The prompt's cascade example names the dearest worker as the strong one: gpt-4o (no pool price,
    $2.5/$10 per million in the map) lost to a $1/$2 worker, as if it cost nothing."""
    planner = {"id": "conductor", "kind": "planner", "model": "openai/sim-planner", "provider": "sim",
               "api_base": fresh.url, "price": {"input_per_mtok": 3.0, "output_per_mtok": 6.0}}
    pool = pool_file(tmp_path / "pool.yaml", llm("small", "fast", fresh.url, 0.7, (0.15, 0.6)),
                     llm("mid", "weak", fresh.url, 0.8, (1, 2)), llm("gpt4o", "gpt-4o", fresh.url, 0.9), planner)
    data = tmp_path / "data"
    queries = tmp_path / "q2.parquet"
    pq.write_table(pq.read_table(q8).slice(0, 2), queries)
    r = run_cli("run", queries, "--pool", pool, "--data-dir", data, "--quiet", "--no-cache", "--planner", "llm",
                "--planner-option", "worker=conductor", "--planner-option", "structured=on")
    assert r.returncode == 0, r.stderr
    system = orjson.loads(plans_of(data, _run_id(r))[0]["planner_prompt"])[0]["content"]
    strong = re.findall(r'\{"worker": "(\w+)", "instruction": "A shop sells pens[^"]*", "access": \[\], '
                        r'"when": \{"disagree": \[0, 1\]\}\}', system)
    assert strong == ["gpt4o"], strong


# ---- F3: max_steps as a planner option ---------------------------------------------------------------------

@pytest.mark.parametrize("given, flags", [("12", []), ("3", ["--max-steps", "7"])])
def test_a_max_steps_planner_option_other_than_max_steps_is_refused_before_planning(fresh, tmp_path, q8,
                                                                                   given, flags):
    """The planner's prompt and schema allowed N steps while plans were validated against --max-steps:
    longer plans were paid for, then thrown away as invalid."""
    planner = {"id": "conductor", "kind": "planner", "model": "openai/sim-planner", "provider": "sim",
               "api_base": fresh.url, "price": {"input_per_mtok": 3.0, "output_per_mtok": 6.0}}
    pool = pool_file(tmp_path / "pool.yaml", llm("small", "fast", fresh.url, 0.7, (0.15, 0.6)), planner)
    data = tmp_path / "data"
    r = run_cli("run", q8, "--pool", pool, "--data-dir", data, "--quiet", "--planner", "llm",
                "--planner-option", "worker=conductor", "--planner-option", f"max_steps={given}", *flags)
    max_steps = flags[1] if flags else "5"
    assert r.returncode == 2, r.stderr
    assert f"--planner-option max_steps={given} differs from --max-steps {max_steps}" in r.stderr
    assert "with --max-steps" in r.stderr and "Traceback" not in r.stderr
    assert not (data / "runs").exists() and fresh.log()["total"] == 0
    # vLLM's too, before its engine loads (a model name the engine never fetches)
    r = run_cli("run", q8, "--pool", pool, "--data-dir", data, "--planner", "vllm", "--planner-model",
                "org/never-fetched", "--planner-option", f"max_steps={given}", *flags)
    assert r.returncode == 2 and f"max_steps={given} differs from --max-steps {max_steps}" in r.stderr, r.stderr
    assert not (data / "runs").exists()


def test_a_max_steps_planner_option_equal_to_max_steps_is_taken(fresh, tmp_path, q8):
    planner = {"id": "conductor", "kind": "planner", "model": "openai/sim-planner", "provider": "sim",
               "api_base": fresh.url, "price": {"input_per_mtok": 3.0, "output_per_mtok": 6.0}}
    pool = pool_file(tmp_path / "pool.yaml", llm("small", "fast", fresh.url, 0.7, (0.15, 0.6)), planner)
    r = run_cli("run", q8, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet", "--planner", "llm",
                "--planner-option", "worker=conductor", "--planner-option", "max_steps=4", "--max-steps", "4")
    assert r.returncode == 0, r.stderr
