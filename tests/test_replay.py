"""Replay pools over real HTTP: the server answers exactly what was recorded and a
labeled error for anything else; pool files import prices and train-split skills;
and a replay pool runs through the whole pipeline (plans, traces, results, rewards)."""

from __future__ import annotations

import asyncio
import json
import re

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.cli import main as cli_main
from conductor.execute.call import CallFailure, CallRequest, complete
from conductor.grading import grade
from conductor.planners.base import PlanDraft
from conductor.pool import load_pool
from conductor.replay import start_replay
from conductor.replay.tables import split_of
from conductor.runner import RunConfig, run_all
from tests.conftest import REPLAY

# slow: the replay server and runs over the shared tables
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not REPLAY.is_dir(), reason=f"shared replay data not found at {REPLAY} (set CONDUCTOR_REPLAY_DIR to its folder)")]

GSM_MODELS = ["gpt-4o-2024-08-06", "gpt-4o-mini-2024-07-18", "Meta-Llama-3.1-8B-Instruct", "gemma-2-2b-it",
              "deepseek-chat"]
# DeepSeek-Coder-V2 left 420 MMLU-Pro questions unanswered: a model that never saw a question.
# It is also the strongest model of this small pool, so the planner wants it wherever it can have it.
MMLU_MODELS = ["DeepSeek-Coder-V2", "Mistral-7B-Instruct-v0.2", "Yi-6b-Chat", "Qwen1.5-7B-Chat"]


SUFFIX = "\n\nAnswer: <number>."


def _table(dataset: str) -> pl.DataFrame:
    return pl.read_parquet(REPLAY / f"{dataset}.parquet")


@pytest.fixture(scope="module")
def gsm(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay-gsm8k")
    pool, queries = d / "pool.yaml", d / "gsm8k.parquet"
    assert cli_main(["replay", "pool", "--dataset", "gsm8k", "--replay-dir", str(REPLAY), "--out", str(pool),
                     "--models", *GSM_MODELS]) == 0
    assert cli_main(["replay", "queries", "--dataset", "gsm8k", "--replay-dir", str(REPLAY),
                     "--out", str(queries)]) == 0
    with start_replay(pool) as server:
        yield {"dir": d, "pool": pool, "queries": queries, "server": server, "table": _table("gsm8k")}


@pytest.fixture(scope="module")
def mmlu(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay-mmlu")
    pool = d / "pool.yaml"
    assert cli_main(["replay", "pool", "--dataset", "mmlu_pro", "--replay-dir", str(REPLAY), "--out", str(pool),
                     "--models", *MMLU_MODELS]) == 0
    with start_replay(pool) as server:
        yield {"dir": d, "pool": pool, "server": server, "table": _table("mmlu_pro")}


def _call(server, model: str, messages: list[dict]):
    req = CallRequest(f"openai/{model}", messages, {"max_tokens": 1024}, server.url, 10.0)
    return asyncio.run(complete(req, "no-key"))


def _row(table: pl.DataFrame, model: str, i: int = 0) -> dict:
    return table.filter(pl.col("model") == model).row(i, named=True)


# ---------------------------------------------------------------- the server


def test_recorded_question_gets_exactly_the_recorded_response_with_estimated_usage(gsm):
    for model, i in (("gpt-4o-2024-08-06", 7), ("gemma-2-2b-it", 300)):
        row = _row(gsm["table"], model, i)
        resp = _call(gsm["server"], model, [{"role": "user", "content": row["question"]}])
        assert resp.text == row["response"]
        assert resp.usage_estimated is True and resp.simulated is False
        assert resp.prompt_tokens == round(len(row["question"]) / 4)
        assert resp.completion_tokens == round(len(row["response"]) / 4)


@pytest.mark.parametrize("case", ["unknown model", "unrecorded question", "altered instruction", "extra turns",
                                  "system message"])
def test_anything_not_recorded_is_a_labeled_422_never_a_response(gsm, case):
    row = _row(gsm["table"], "gpt-4o-2024-08-06", 3)
    q = row["question"]
    model, messages, words = {
        "unknown model": ("gpt-5-imaginary", [{"role": "user", "content": q}], "model 'gpt-5-imaginary' has no recorded"),
        "unrecorded question": ("gpt-4o-2024-08-06", [{"role": "user", "content": "What is 2 + 2?"}],
                                "is not a question of gsm8k.parquet"),
        "altered instruction": ("gpt-4o-2024-08-06", [{"role": "user", "content": q + SUFFIX}],
                                f"question {row['question_id']} of gsm8k.parquet with {len(SUFFIX)} character(s) added"),
        "extra turns": ("gpt-4o-2024-08-06", [{"role": "user", "content": q}, {"role": "assistant", "content": "42"},
                                              {"role": "user", "content": q}], "has 3 message(s)"),
        "system message": ("gpt-4o-2024-08-06", [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": q}], "roles: system, user"),
    }[case]
    gsm["server"].reset()
    with pytest.raises(CallFailure) as e:
        _call(gsm["server"], model, messages)
    assert e.value.status == 422 and not e.value.retryable
    assert "not recorded: " in str(e.value) and words in str(e.value)
    log = gsm["server"].log()
    assert log["by_status"] == {"422": 1} and "recorded" not in log["by_outcome"]


def test_a_model_that_never_saw_the_question_is_a_labeled_error(mmlu):
    t = mmlu["table"]
    answered = set(t.filter(pl.col("model") == "DeepSeek-Coder-V2").get_column("question_id"))
    unseen = t.filter(~pl.col("question_id").is_in(list(answered))).row(0, named=True)
    with pytest.raises(CallFailure) as e:
        _call(mmlu["server"], "DeepSeek-Coder-V2", [{"role": "user", "content": unseen["question"]}])
    assert e.value.status == 422
    assert (f"not recorded: model 'DeepSeek-Coder-V2' has no recorded response to question "
            f"{unseen['question_id']} of mmlu_pro.parquet") in str(e.value)
    # Another model did answer it, so the question itself is known.
    other = _call(mmlu["server"], "Yi-6b-Chat", [{"role": "user", "content": unseen["question"]}])
    assert other.text == t.filter((pl.col("model") == "Yi-6b-Chat")
                                  & (pl.col("question_id") == unseen["question_id"])).item(0, "response")


def test_start_replay_names_a_pool_model_the_table_does_not_hold(tmp_path, gsm):
    doc = yaml.safe_load(gsm["pool"].read_text())
    doc["workers"][0]["model"] = "openai/not-a-recorded-model"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(Exception, match="no responses of model\\(s\\) not-a-recorded-model"):
        start_replay(bad)


# ---------------------------------------------------------------- pool and query files


@pytest.mark.parametrize("change, words", [
    ({"colour": "blue"}, "replay.colour: unknown field"),
    ({"table": "nowhere.parquet"}, "replay.table: "),
    ({"split": {"salt": "other", "train_fraction": 0.7}}, "replay.split: "),
])
def test_replay_block_errors_name_the_field(gsm, tmp_path, change, words):
    from conductor.errors import PoolError
    from conductor.replay.tables import replay_source

    doc = yaml.safe_load(gsm["pool"].read_text())
    doc["replay"].update(change)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(PoolError, match=re.escape(f"pool file {path}: {words}")):
        replay_source(load_pool(path))


def test_pool_imports_prices_and_train_split_skills(gsm):
    pool = load_pool(gsm["pool"])
    prices = {r["model"]: r for r in pl.read_csv(REPLAY / "prices.csv").to_dicts()}
    t = gsm["table"].with_columns(pl.col("question_id").map_elements(split_of, return_dtype=pl.String).alias("split"))
    train = t.filter(pl.col("split") == "train").group_by("model").agg(pl.col("correct").mean())
    train_acc = dict(train.iter_rows())
    llm = [w for w in pool.workers if w.kind == "llm"]
    assert [w.model for w in llm] == [f"openai/{m}" for m in GSM_MODELS]
    for w in llm:
        name = w.model.split("/", 1)[1]
        assert w.price.input == pytest.approx(prices[name]["input_usd_per_mtok"] / 1e6)
        assert w.price.output == pytest.approx(prices[name]["output_usd_per_mtok"] / 1e6)
        assert w.skills == {"math": pytest.approx(train_acc[name], abs=1e-4)}
        assert w.api_base == "http://127.0.0.1:8912/v1" and w.description.startswith(name)
    assert {(w.id, w.function) for w in pool.workers if w.kind == "function"} == {("vote", "vote"),
                                                                                   ("extract", "extract")}
    assert pool.replay["dataset"] == "gsm8k" and pool.replay["table"] == str((REPLAY / "gsm8k.parquet").resolve())
    assert "not commit" in gsm["pool"].read_text().splitlines()[0] + gsm["pool"].read_text().splitlines()[1]


def test_pool_command_names_an_unrecorded_model(tmp_path, capsys):
    assert cli_main(["replay", "pool", "--dataset", "gsm8k", "--replay-dir", str(REPLAY),
                     "--out", str(tmp_path / "p.yaml"), "--models", "gpt-4o-2024-08-06", "gpt-7"]) == 2
    assert "--models: gpt-7 not recorded in" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()


def test_query_sets_split_deterministically_by_question_id(gsm, tmp_path):
    q = pq.read_table(gsm["queries"]).to_pylist()
    t = gsm["table"].unique(subset=["question_id"], keep="first", maintain_order=True)
    assert [r["query_id"] for r in q] == t.get_column("question_id").to_list()
    assert [r["prompt"] for r in q] == t.get_column("question").to_list()  # the question exactly
    assert {r["task"] for r in q} == {"math"}
    assert [r["reference"] for r in q] == t.get_column("reference").to_list()
    meta = [json.loads(r["metadata"]) for r in q]
    assert {m["dataset"] for m in meta} == {"gsm8k"}
    assert all(m["split"] == split_of(r["query_id"]) for m, r in zip(meta, q))
    n_train = sum(m["split"] == "train" for m in meta)
    assert 0.45 < n_train / len(q) < 0.55
    for split in ("train", "test"):
        out = tmp_path / f"{split}.parquet"
        assert cli_main(["replay", "queries", "--dataset", "gsm8k", "--replay-dir", str(REPLAY), "--split", split,
                         "--out", str(out)]) == 0
        ids = pq.read_table(out).column("query_id").to_pylist()
        assert ids == [r["query_id"] for r, m in zip(q, meta) if m["split"] == split]


# ---------------------------------------------------------------- through the executor and the pipeline


class _ScriptedPlanner:
    """Plans one step per query for a fixed worker, optionally altering the question."""

    name = "scripted"

    def __init__(self, worker: str, alter: set[str]):
        self.worker, self.alter = worker, alter

    def plan(self, queries, pool, samples):
        out = []
        for q in queries:
            text = q.prompt + (" Show your work." if q.query_id in self.alter else "")
            out.append([PlanDraft(text=orjson.dumps({"steps": [
                {"worker": self.worker, "instruction": text, "access": []}]}).decode())] * samples)
        return out


def test_executor_records_not_recorded_per_step_and_keeps_the_worker(gsm, tmp_path, monkeypatch):
    monkeypatch.setenv("CONDUCTOR_REPLAY_URL", gsm["server"].url)
    queries = tmp_path / "q.parquet"
    pq.write_table(pq.read_table(gsm["queries"]).slice(0, 6), queries)
    first = pq.read_table(queries).column("query_id")[0].as_py()
    cfg = RunConfig(queries=queries, pool=gsm["pool"], data_dir=tmp_path / "data", run_id="scripted",
                    cache=False, progress=False)
    summary = run_all(cfg, planner=_ScriptedPlanner("gpt-4o-2024-08-06", {first}))
    assert summary["statuses"] == {"error": 1, "ok": 5}  # the worker was not marked dead after the 422
    traces = pq.read_table(tmp_path / "data" / "runs" / "scripted" / "traces.parquet").to_pylist()
    bad = [t for t in traces if t["query_id"] == first]
    assert len(bad) == 1 and bad[0]["status"] == "error" and bad[0]["response_text"] is None
    assert "not recorded: the instruction is question" in bad[0]["error"]
    assert all(t["status"] == "ok" and t["usage_estimated"] for t in traces if t["query_id"] != first)


def _run(pool, queries, tmp_path, run_id, options):
    """Plan, execute, grade and report `queries` (a table) over a replay pool with the embedded planner."""
    path = tmp_path / f"{run_id}.parquet"
    pq.write_table(queries, path)
    cfg = RunConfig(queries=path, pool=pool, data_dir=tmp_path / "data", run_id=run_id,
                    planner_options=options, cache=False, progress=False)
    summary = run_all(cfg)
    run = tmp_path / "data" / "runs" / run_id
    return summary, {name: pq.read_table(run / f"{name}.parquet").to_pylist()
                     for name in ("plans", "traces", "results", "rewards")}


def test_replay_pool_runs_end_to_end_through_the_pipeline(gsm, tmp_path, monkeypatch):
    monkeypatch.setenv("CONDUCTOR_REPLAY_URL", gsm["server"].url)
    server, table = gsm["server"], gsm["table"]
    pool = load_pool(gsm["pool"])
    recorded = {(r["model"], r["question_id"]): r["response"] for r in table.iter_rows(named=True)}
    prompts = {r["query_id"]: r["prompt"] for r in pq.read_table(gsm["queries"]).to_pylist()}
    refs = {r["query_id"]: r["reference"] for r in pq.read_table(gsm["queries"]).to_pylist()}
    server.reset()
    # Accuracy only: parallel ensembles closed by a vote. Cost dominant: the cheapest single worker.
    shapes = {"vote": ({"cost_weight": 0.0}, "ensemble"), "single": ({"cost_weight": 1e6}, "single")}
    llm_steps = 0
    for run_id, (options, template) in shapes.items():
        summary, out = _run(gsm["pool"], pq.read_table(gsm["queries"]).slice(0, 40), tmp_path, run_id, options)
        assert summary["queries"] == 40 and summary["valid_plans"] == 40 and summary["statuses"] == {"ok": 40}
        for plan in out["plans"]:
            assert plan["valid"] and json.loads(plan["info_json"])["template"] == template
            steps = json.loads(plan["steps_json"])["steps"]
            solvers = [s for s in steps if s["worker"] not in ("vote", "extract")]
            assert all(s["instruction"] == prompts[plan["query_id"]] for s in solvers)  # the question verbatim
            if template == "ensemble":
                assert len(solvers) == 3 and (steps[-1]["worker"], steps[-1]["access"]) == ("vote", [0, 1, 2])
            else:
                assert len(steps) == 1
        for t in out["traces"]:
            assert t["status"] == "ok"
            if t["worker"] == "vote":
                assert t["cost_usd"] == 0.0 and t["attempts"] == 0
                continue
            llm_steps += 1
            model = t["model"].split("/", 1)[1]
            assert t["response_text"] == recorded[(model, t["query_id"])]
            assert t["usage_estimated"] is True and t["simulated"] is False
            price = pool.worker(t["worker"]).price
            assert t["prompt_tokens"] == round(len(prompts[t["query_id"]]) / 4)
            assert t["cost_usd"] == pytest.approx(t["prompt_tokens"] * price.input
                                                  + t["completion_tokens"] * price.output)
        results = {r["plan_id"]: r for r in out["results"]}
        for r in out["rewards"]:
            final = results[r["plan_id"]]["final_answer"]
            assert r["correct"] == grade("math", final, refs[r["query_id"]]).correct
            assert r["reward"] == (1.0 if r["correct"] else 0.5 if r["parsed"] else 0.0)
        if template == "ensemble":
            assert all(results[p]["final_answer"].splitlines()[-1].startswith("Answer: ") for p in results)
            assert summary["accuracy"] >= 0.85  # three strong models and a vote
    log = server.log()
    assert log["by_outcome"] == {"recorded": llm_steps} and log["by_status"] == {"200": llm_steps}


def test_planner_uses_only_workers_that_recorded_the_question(mmlu, tmp_path, monkeypatch):
    monkeypatch.setenv("CONDUCTOR_REPLAY_URL", mmlu["server"].url)
    t = mmlu["table"]
    answered = set(t.filter(pl.col("model") == "DeepSeek-Coder-V2").get_column("question_id"))
    unseen = t.filter(~pl.col("question_id").is_in(list(answered))).get_column("question_id").unique(
        maintain_order=True).to_list()[:10]
    seen = sorted(answered)[:10]
    path = mmlu["dir"] / "queries.parquet"
    assert cli_main(["replay", "queries", "--dataset", "mmlu_pro", "--replay-dir", str(REPLAY),
                     "--out", str(path)]) == 0
    queries = pq.read_table(path)
    queries = queries.filter(pc.is_in(queries.column("query_id"), pa.array(unseen + seen)))
    mmlu["server"].reset()
    summary, out = _run(mmlu["pool"], queries, tmp_path, "coverage", {"cost_weight": 0.0})
    assert summary["statuses"] == {"ok": 20}
    used = {p["query_id"]: set(p["workers"]) for p in out["plans"]}
    assert all("DeepSeek-Coder-V2" in used[q] for q in seen)
    assert all("DeepSeek-Coder-V2" not in used[q] for q in unseen)
    assert "not_recorded:unseen_question" not in mmlu["server"].log()["by_outcome"]
