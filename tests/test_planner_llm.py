"""The LLM planner (any chat model through litellm) against the simulated server:
the server's planner behaviour, structured and free planning through the
executor (journal, cost, cache), a killed planning stage, and budgets that count
what planning spent."""

from __future__ import annotations

import re
import urllib.request

import orjson
import pyarrow.parquet as pq
import pytest
from jsonschema import Draft202012Validator

from conductor.errors import ConductorError
from conductor.planners import make_planner
from conductor.planners import prompt as P
from conductor.planners.base import Query
from conductor.planners.schema import plan_schema
from conductor.plans import parse_plan
from conductor.pool import load_pool
from conductor.runner import RunConfig, run_all
from tests import plannersim
from tests.conftest import cli, kill_when_journaled, run_cli
from tests.plannersim import psim, queries, sim  # noqa: F401  (shared fixtures)

# slow: the LLM planner over HTTP, through the CLI
pytestmark = pytest.mark.slow

LLM = {"worker": "conductor", "structured": "on", "temperature": 1.0}


def run(tmp_path, pool, queries, *, run_id=None, data="data", **kw):
    cfg = RunConfig(queries=queries, pool=pool, data_dir=tmp_path / data, run_id=run_id, progress=False,
                    planner="llm", **kw)
    summary = run_all(cfg)
    return summary, tmp_path / data / "runs" / summary["run_id"]


def journal(run_dir, name="planner"):
    path = run_dir / "work" / name / "steps.jsonl" if name else run_dir / "work" / "steps.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def post(sim, body: dict) -> dict:
    req = urllib.request.Request(sim.url + "/chat/completions", data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"}, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=10) as resp:
        return orjson.loads(resp.read())


# ---- the simulated planner --------------------------------------------------

def test_sim_planner_answers_a_json_schema_with_a_valid_plan_fixed_per_request(sim, tmp_path, queries):
    pool = load_pool(plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=plannersim.planner_worker(
        sim.url)))
    schema = plan_schema(pool, max_steps=4, instruction_chars=400)
    validator = Draft202012Validator(schema)
    q = Query("q", pq.read_table(queries).column("prompt")[0].as_py(), "math")
    texts = []
    for seed in range(20):
        body = {"model": "sim-replanner", "seed": seed, "messages": P.messages(q, pool, "structured", 4,
                                                                             instruction_chars=400),
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "plan", "schema": schema, "strict": True}}}
        text = post(sim, body)["choices"][0]["message"]["content"]
        assert post(sim, body)["choices"][0]["message"]["content"] == text  # fixed per request
        doc = orjson.loads(text)
        validator.validate(doc)  # enum workers, step bounds, access to earlier steps only, instruction pattern
        plan = parse_plan(text, pool, max_steps=4)
        assert q.prompt in plan.steps[0].instruction  # quoted verbatim, so workers can answer it
        texts.append(text)
    assert len(set(texts)) >= 4  # the seed changes the plan
    workers = {s["worker"] for t in texts for s in orjson.loads(t)["steps"]}
    assert "conductor" in workers and {"fast", "weak"} & workers  # replan_rate 1: planner steps appear

    other = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 5},
                                              "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                       "minItems": 1, "maxItems": 2}},
             "required": ["n", "tags"], "additionalProperties": False}
    body = {"model": "sim-planner", "messages": [{"role": "user", "content": "anything"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": other}}}
    Draft202012Validator(other).validate(orjson.loads(post(sim, body)["choices"][0]["message"]["content"]))


def test_sim_planner_without_a_schema_reasons_then_writes_three_lists(sim, tmp_path, queries):
    pool = load_pool(plannersim.pool_file(tmp_path / "pool.yaml", sim.url))
    q = Query("q", "What is 6 times 7?\nThink first.", "math")
    body = {"model": "sim-planner", "seed": 3, "logprobs": True, "messages": P.messages(q, pool, "free")}
    choice = post(sim, body)["choices"][0]
    text = choice["message"]["content"]
    assert text.splitlines()[0].startswith("Reasoning: ")
    assert "model_id = [" in text and "subtasks = [" in text and "access_list = [" in text
    plan = parse_plan(text, pool)
    assert plan.steps[0].instruction.startswith(q.prompt)  # free text keeps the newline
    assert {s.worker for s in plan.steps} <= {"fast", "weak", "vote"}
    tokens = choice["logprobs"]["content"]
    assert "".join(t["token"] for t in tokens) == text and all(t["logprob"] <= 0 for t in tokens)
    assert post(sim, {**body, "logprobs": False})["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("simulate, message", [
    ({"role": "boss"}, "simulate.role: must be one of worker, planner (got 'boss')"),
    ({"role": "planner", "replan_rate": 2}, "simulate.replan_rate: must be a fraction in [0, 1]"),
])
def test_bad_planner_simulation_settings_are_refused(simulate, message):
    from conductor.pool import parse_pool
    from conductor.sim.config import SimConfigError, served_models

    pool = parse_pool({"workers": [{"id": "p", "kind": "planner", "model": "openai/p", "simulate": simulate}]})
    with pytest.raises(SimConfigError, match=re.escape(f"worker p: {message}")):
        served_models(pool)


# ---- planning through the executor -----------------------------------------

def test_structured_plans_go_through_the_executor_journal_and_cache(sim, tmp_path, queries):
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=plannersim.planner_worker(sim.url))
    summary, run_dir = run(tmp_path, pool, queries, samples=3, planner_options=LLM, run_id="one")

    plans = pq.read_table(run_dir / "plans.parquet").to_pylist()
    assert len(plans) == 36 and all(p["valid"] for p in plans)
    rows = journal(run_dir)
    assert len(rows) == 36 and sim.log()["by_model"]["sim-planner"] == 36
    by_plan = {r["plan_id"]: r for r in rows}
    for p in plans:
        info = orjson.loads(p["info_json"])
        r = by_plan[p["plan_id"]]
        assert p["planner"] == "llm" and p["template_version"] == P.TEMPLATE_VERSION
        assert info["mode"] == "structured" and info["worker"] == "conductor" and info["seed"] == p["sample"]
        assert p["raw_text"] == r["response_text"] and p["prompt_tokens"] == r["prompt_tokens"] > 0
        assert p["completion_tokens"] == r["completion_tokens"] > 0
        assert p["logprob"] is not None and p["logprob"] < 0  # requested: litellm says openai/ supports logprobs
        msgs = orjson.loads(p["planner_prompt"])
        assert msgs[0]["content"] == P.system_prompt(load_pool(pool), "structured")
        # Priced from the pool worker: $3 / $6 per million tokens.
        cost = (r["prompt_tokens"] * 3 + r["completion_tokens"] * 6) / 1e6
        assert r["cost_usd"] == pytest.approx(cost) and info["cost_usd"] == pytest.approx(cost)
        assert r["model"] == "openai/sim-planner" and r["provider"] == "sim" and r["attempts"] == 1
    texts = {}
    for p in plans:
        texts.setdefault(p["query_id"], set()).add(p["raw_text"])
    assert sum(len(t) > 1 for t in texts.values()) >= 9  # K samples differ (seed per sample)
    assert summary["statuses"].get("ok", 0) > 0  # and the plans ran
    planning = sum(r["cost_usd"] for r in rows)
    results = pq.read_table(run_dir / "results.parquet", columns=["cost_usd"]).column("cost_usd").to_pylist()
    assert summary["planning_cost_usd"] == pytest.approx(planning)  # the summary's cost includes planning
    assert summary["cost_usd"] == pytest.approx(planning + sum(results))

    # Another run with the same inputs: every planning call comes from the cache.
    sent = sim.log()["by_model"]["sim-planner"]
    _, again = run(tmp_path, pool, queries, samples=3, planner_options=LLM, run_id="two")
    assert sim.log()["by_model"]["sim-planner"] == sent
    assert all(r["cache_hit"] and r["cost_usd"] == 0 and r["attempts"] == 0 for r in journal(again))
    assert [p["raw_text"] for p in pq.read_table(again / "plans.parquet").to_pylist()] == \
        [p["raw_text"] for p in plans]


def test_free_mode_when_the_model_has_no_response_schema(sim, tmp_path, queries):
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=plannersim.planner_worker(sim.url))
    # structured=auto: litellm does not list openai/sim-planner as supporting response_format schemas.
    summary, run_dir = run(tmp_path, pool, queries, samples=2, planner_options={"worker": "conductor"})
    plans = pq.read_table(run_dir / "plans.parquet").to_pylist()
    assert all(p["valid"] for p in plans)
    for p in plans:
        assert orjson.loads(p["info_json"])["mode"] == "free"
        assert p["raw_text"].startswith("Reasoning: ") and "access_list = [" in p["raw_text"]
        assert "model_id = [" in orjson.loads(p["planner_prompt"])[0]["content"]
    assert summary["statuses"].get("ok", 0) > 0


def test_planner_model_string_adds_an_implicit_worker(sim, tmp_path, queries):
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url)  # no planner worker in the pool
    data = tmp_path / "data"
    args = ["run", queries, "--pool", pool, "--data-dir", data, "--planner", "llm", "--quiet",
            "--planner-model", "openai/sim-planner", "--planner-option", f"api_base={sim.url}"]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert "Unclosed" not in r.stderr  # the planner's HTTP sessions are closed, not left to the collector
    run_dir = next((data / "runs").iterdir())
    rows = journal(run_dir)
    assert len(rows) == 12 and {(r["worker"], r["provider"]) for r in rows} == {("conductor-planner", "openai")}
    assert all(r["cost_usd"] is None for r in rows)  # no price known for this model: unknown, not $0
    assert "12 planning call(s) with unknown price" in r.stdout  # and the summary says so
    assert all(p["valid"] for p in pq.read_table(run_dir / "plans.parquet").to_pylist())

    # Under a budget, a planner without a price is refused before any call.
    sent = sim.log()["total"]
    r = cli(*args[:5], tmp_path / "other", *args[6:], "--budget", "1")
    assert r.returncode == 2 and "no known price for model openai/sim-planner" in r.stderr
    assert sim.log()["total"] == sent


@pytest.mark.parametrize("extra, message", [
    ([], "model openai/gpt-4o needs OPENAI_API_KEY, which is not set"),
    (["--planner-option", "api_key_env=MY_PLANNER_KEY"], "environment variable MY_PLANNER_KEY is not set"),
    (["--planner-option", "api_base=http://127.0.0.1:9/v1"],
     "LLM planner: cannot plan: --planner-model openai/gpt-4o: cannot reach http://127.0.0.1:9/v1"),
])
def test_a_hosted_planner_without_its_key_or_server_stops_before_any_call(tmp_path, queries, monkeypatch, extra,
                                                                          message):
    """Not six retries of 'Missing credentials' after the run folder exists: the variable is named.
    Found by planning, these left a run folder behind in status `planning`."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("MY_PLANNER_KEY", raising=False)
    if "api_base" in str(extra):
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    pool = plannersim.pool_file(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1")
    r = cli("run", queries, "--pool", pool, "--data-dir", tmp_path / "data", "--planner", "llm", "--quiet",
            "--planner-model", "openai/gpt-4o", *extra)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "data" / "runs").exists()


@pytest.mark.parametrize("options, message", [
    ({"worker": "fast"}, "worker fast must be of kind planner"),
    ({"worker": "nobody"}, "worker 'nobody' is not in the pool"),
    ({}, "name its model with --planner-model"),
    ({"model": "openai/x", "worker": "conductor"}, "give either model"),
    ({"structured": "maybe"}, "structured must be one of auto, on, off"),
])
def test_bad_planner_selection_is_refused_clearly(tmp_path, options, message):
    pool = load_pool(plannersim.pool_file(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1"))
    with pytest.raises(ConductorError, match=message):
        make_planner("llm", **options).plan([Query("q", "What is 1 + 1?", "math")], pool, 1)


# ---- resume and budgets -----------------------------------------------------

def test_killed_planning_resumes_without_paying_twice(sim, tmp_path, queries):
    sim.set_faults("sim-planner", latency_ms=150, latency_sd_ms=0)
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=plannersim.planner_worker(sim.url),
                                providers={"sim": {"max_concurrency": 4}})
    data = tmp_path / "data"
    args = ["run", str(queries), "--pool", str(pool), "--planner", "llm", "--samples",
            "3", "--planner-option", "worker=conductor", "--quiet", "--no-cache"]
    run_dir = kill_when_journaled(args, data, 12, journal="work/planner/steps.jsonl", timeout=60)
    assert run_dir is not None, "planning finished before it could be killed"
    assert not (run_dir / "plans.parquet").exists()
    finished = {r["request_key"] for r in journal(run_dir) if r["status"] == "ok" and r["attempts"]}
    sent_then = sim.log()["by_request_key"]
    assert 12 <= len(finished) < 36

    r = cli(*args, "--data-dir", data)
    assert r.returncode == 0, r.stderr
    assert "(resumed)" in r.stdout
    sent = sim.log()["by_request_key"]
    assert all(sent[k] == sent_then[k] == 1 for k in finished)  # no finished planning call was sent again
    assert len({r["request_key"] for r in journal(run_dir)}) == 36
    plans = pq.read_table(run_dir / "plans.parquet").to_pylist()
    assert len(plans) == 36 and all(p["valid"] for p in plans)


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_planning_awaits_the_planning_calls_in_flight(sim, tmp_path, queries, sig, code):
    """audit49 F3: planning calls were cut off at Ctrl-C or SIGTERM (32 of them there), and the
    rerun sent, and a provider would bill, them again. Then, about one run in three, the first call
    to end let a waiting one raise Aborted, which ended the gather and cut off the other three."""
    import signal
    import time

    p, args, data = plannersim.slow_planning(sim, tmp_path, queries, "--quiet")
    time.sleep(0.5)  # the next calls are in flight
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    assert "waiting up to 20 s for" in err and "call(s) in flight so their answers are kept" in err, err
    assert "Traceback" not in err and "never retrieved" not in err, err
    sim.clear_faults()
    r = cli(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    log = sim.log()
    sent = log["by_request_key"]  # answers delivered, by request
    planned = {row["request_key"] for row in journal(next((data / "runs").iterdir()))}
    twice = {k: sent.get(k) for k in planned if sent.get(k) != 1}
    assert len(planned) == 36 and not twice, (twice, err)
    # nor cut off before its answer came (the server saw the client go, 499): one request each
    assert log["by_model"]["sim-planner"] == 36, (log["by_model"], log["by_status"], err)


@pytest.mark.parametrize("cap", ["run", "provider"])
def test_budgets_count_what_planning_spent(sim, tmp_path, queries, cap):
    planner = plannersim.planner_worker(sim.url)
    # Workers far dearer than planning, so that half of the execution is worth many planning calls.
    price = {"input_per_mtok": 100.0, "output_per_mtok": 200.0}
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=planner, price=price)
    _, ref = run(tmp_path, pool, queries, samples=2, planner_options=LLM, data="ref", cache=False)
    planning = sum(r["cost_usd"] for r in journal(ref))
    executing = sum(t["cost_usd"] or 0 for t in pq.read_table(ref / "traces.parquet").to_pylist())
    assert planning > 0 and executing > 0
    budget = planning + executing / 2  # room for all the planning and half the execution

    def capped(limit):
        if cap == "run":
            return pool, {"budget_usd": limit}
        path = plannersim.pool_file(tmp_path / f"capped-{limit}.yaml", sim.url, planner=planner, price=price,
                                    providers={"sim": {"max_concurrency": 16, "budget_usd": limit}})
        return path, {}

    path, kw = capped(budget)
    summary, run_dir = run(tmp_path, path, queries, samples=2, planner_options=LLM, data="capped", cache=False,
                           **kw)
    spent_planning = sum(r["cost_usd"] for r in journal(run_dir))
    spent_executing = sum(t["cost_usd"] or 0 for t in pq.read_table(run_dir / "traces.parquet").to_pylist())
    assert spent_planning == pytest.approx(planning)
    assert summary["statuses"].get("budget_exhausted", 0) > 0  # planning's spend left too little for all of it
    assert spent_planning + spent_executing <= budget + 1e-9
    spend = {c["cap"]: c["spent_usd"] for c in orjson.loads((run_dir / "manifest.json").read_bytes())["spend"]}
    name = "run" if cap == "run" else "provider sim"
    assert spend[name] == pytest.approx(spent_planning + spent_executing, abs=1e-6)

    # A cap smaller than planning needs stops the planning stage, which a larger cap then finishes.
    sim.reset()
    path, kw = capped(planning * 3 / 4)
    with pytest.raises(ConductorError, match="stopped by a budget") as stopped:
        run(tmp_path, path, queries, samples=2, planner_options=LLM, data="small", cache=False, run_id="s", **kw)
    assert stopped.value.exit_code == 3  # `conductor run`'s: calls were sent and paid, so not 2 (nothing called)
    # which cap, and what the call needed (audit67 F7: "stopped by a budget" alone did not say)
    assert "stopped by a budget (the first: worker conductor: budget exhausted: " in str(stopped.value), stopped.value
    paid = sim.log()["by_request_key"]
    small = tmp_path / "small" / "runs" / "s"
    assert 0 < sum(r["cost_usd"] or 0 for r in journal(small)) <= planning * 3 / 4 + 1e-9
    path, kw = capped(10 * budget)
    summary, _ = run(tmp_path, path, queries, samples=2, planner_options=LLM, data="small", cache=False, run_id="s",
                     **kw)
    if cap == "run":  # the note on the new budget: no plan had run before (it said "the 0 finished before ran")
        (note,) = [n for n in summary["notes"] if "applies to the" in n]
        assert note.endswith("applies to the 24 plan(s) left to run; none had finished before"), note
    assert all(sim.log()["by_request_key"][k] == 1 for k in paid)
    assert len(pq.read_table(small / "plans.parquet")) == 24


def test_planning_calls_never_answered_count_against_the_execution_budget(sim, tmp_path, queries):
    """A planning request cut off by timeout_s, or in flight when planning was killed, may have
    been billed: its reservation stays unsettled in the planner's journal, and the execution under
    the same budget must count it at its worst case, as it counts its own (it counted only the
    planning calls logged)."""
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=plannersim.planner_worker(sim.url))
    summary, run_dir = run(tmp_path, pool, queries, samples=2, planner_options=LLM, budget_usd=100.0)
    before = {c["cap"]: c["spent_usd"] for c in summary["spend"]}["run"]
    with open(run_dir / "work" / "planner" / "reservations.jsonl", "ab") as f:  # sent, never answered
        f.write(orjson.dumps({"id": "k:1:1", "key": "k", "provider": "sim", "usd": 0.25, "_seq": 1}) + b"\n")
    summary, _ = run(tmp_path, pool, queries, samples=2, planner_options=LLM, budget_usd=100.0)
    assert {c["cap"]: c["spent_usd"] for c in summary["spend"]}["run"] == pytest.approx(before + 0.25)
    assert summary["lost_in_flight"] == {"calls": 1, "reserved_usd": 0.25}  # and said, in the summary


@pytest.mark.parametrize("option, words", [
    ({"kinds": ["function"]}, "kinds must include llm or planner"),
    ({"max_steps": 50}, "max_steps must be a whole number from 1 to 20 (got 50)"),
])
def test_a_plan_shape_no_schema_can_hold_is_refused(option, words):
    with pytest.raises(ConductorError, match=re.escape(f"LLM planner: {words}")):
        make_planner("llm", model="openai/planner", **option)
