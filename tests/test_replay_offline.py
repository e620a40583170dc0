"""Actions played in memory on a replay table (`conductor.replay.offline`) score and cost
exactly what the pipeline logs when it runs them against the replay server, and `eval`
charges a single worker what a plan running it is charged: answers longer than max_tokens
are counted at max_tokens, as the executor counts them, and a question whose text another
id shares gets the answer the server gives that text."""

from __future__ import annotations

import sys

import orjson
import polars as pl
import pyarrow.parquet as pq
import pytest

from conductor.cli import main as cli_main
from conductor.evaluation.table import build_matrix
from conductor.localserver import start_server
from conductor.policy.actions import Action
from conductor.pool import load_pool
from conductor.replay.main import READY
from conductor.replay.offline import Recorded
from conductor.replay.process import ReplayHandle
from conductor.runner import planning_pool
from tests.conftest import REPLAY

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not REPLAY.is_dir(), reason=f"shared replay data not found at {REPLAY} (set CONDUCTOR_REPLAY_DIR to its folder)")]

MODELS = ["gpt4o-2024-05", "gemini-1.5-flash-002", "Meta-Llama-3_1-70B-Instruct", "deepseek-2024-05"]
CAP = 1024  # the executor's default max_tokens


def _table() -> tuple[pl.DataFrame, pl.Series]:
    """20 questions all four models answered, 3 with an answer over CAP tokens, two ids that
    share a question text, and one model's recorded prompt tokens."""
    t = pl.read_parquet(REPLAY / "mmlu_pro.parquet").filter(pl.col("model").is_in(MODELS))
    full = t.group_by("question_id").len().filter(pl.col("len") == len(MODELS)).get_column("question_id")
    t = t.filter(pl.col("question_id").is_in(full.implode()))
    long = t.filter(pl.col("response").str.len_chars() > 4 * CAP + 200).get_column("question_id").unique(
        maintain_order=True).head(3)
    shared = (t.group_by("question", maintain_order=True).agg(pl.col("question_id").unique(maintain_order=True))
              .filter(pl.col("question_id").list.len() == 2).get_column("question_id").head(1).explode())
    ids = set(t.get_column("question_id").unique(maintain_order=True).head(20)) | set(long) | set(shared)
    # One model's log counts a few-shot prefix the question lacks: more prompt tokens than the question
    # has bytes, which the executor charges at that bound (engine._clamped), and so must eval and training.
    logged = pl.when(pl.col("model") == MODELS[0]).then(pl.col("question").str.len_bytes().cast(pl.Int64) + 500)
    return t.filter(pl.col("question_id").is_in(list(ids))).with_columns(
        pl.lit("choice").alias("task"), logged.alias("prompt_tokens")), shared


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    d = tmp_path_factory.mktemp("offline")
    t, shared = _table()
    table, queries, pool = d / "few.parquet", d / "queries.parquet", d / "pool.yaml"
    t.write_parquet(table)
    assert cli_main(["replay", "queries", "--table", str(table), "--out", str(queries),
                     "--replay-dir", str(REPLAY)]) == 0
    assert cli_main(["replay", "pool", "--table", str(table), "--out", str(pool), "--replay-dir", str(REPLAY)]) == 0
    cmd = [sys.executable, "-m", "conductor", "replay", "serve", "--pool", str(pool), "--port", "0"]
    data = d / "data"
    with (start_server(cmd, READY, ReplayHandle, "127.0.0.1", startup_timeout_s=60) as server,
          pytest.MonkeyPatch.context() as mp):
        mp.setenv("CONDUCTOR_REPLAY_URL", server.url)  # the `replay serve` started above
        assert cli_main(["policy", "rollouts", str(queries), "--pool", str(pool), "-k", "all", "--run-id", "sweep",
                         "--data-dir", str(data), "--policy", "none", "--quiet"]) == 0
    run = data / "runs" / "sweep"
    yield {"table": table, "queries": queries, "pool": planning_pool(load_pool(pool)), "run": run,
           "shared": list(shared), "long": t.filter(pl.col("response").str.len_chars() > 4 * CAP + 200)}


def _paid(run) -> dict[str, float]:
    """Per plan, what its steps cost when first paid for (a plan served from the sweep's cache
    is charged like its twin that was not, as training charges it)."""
    out: dict[str, float] = {}
    for t in pq.read_table(run / "traces.parquet").to_pylist():
        out[t["plan_id"]] = out.get(t["plan_id"], 0.0) + (t["original_cost_usd"] or 0.0)
    return out


def test_actions_played_in_memory_match_the_pipelines_sweep(swept):
    plans = {p["plan_id"]: p for p in pq.read_table(swept["run"] / "plans.parquet").to_pylist() if p["valid"]}
    paid = _paid(swept["run"])
    rewards = {r["plan_id"]: r["correct"] for r in pq.read_table(swept["run"] / "rewards.parquet").to_pylist()}
    queries = pq.read_table(swept["queries"]).to_pylist()
    rec = Recorded(swept["table"], swept["pool"], {q["query_id"]: q["reference"] for q in queries}, "choice")
    actions = {orjson.loads(p["info_json"])["action"] for p in plans.values()}
    assert len(actions) > 10 and any(a.startswith("cascade:") for a in actions)
    played = {a: rec.play(Action.from_key(a), [q["query_id"] for q in queries]) for a in actions}
    for pid, p in plans.items():
        correct, usd, _ = played[orjson.loads(p["info_json"])["action"]][p["query_id"]]
        assert (correct, usd) == (rewards[pid], pytest.approx(paid[pid], rel=1e-9, abs=1e-15)), pid
    # The cap mattered: a long answer is charged CAP completion tokens, not its length / 4.
    q, model = swept["long"].row(0, named=True)["question_id"], swept["long"].row(0, named=True)["model"]
    wid = next(w.id for w in swept["pool"].workers if w.model == f"openai/{model}")
    price = swept["pool"].worker(wid).price
    traces = pq.read_table(swept["run"] / "traces.parquet").to_pylist()
    step = next(t for t in traces if t["query_id"] == q and t["worker"] == wid and t["status"] == "ok")
    assert step["completion_tokens"] == CAP
    assert rec.usd[wid][q] == pytest.approx(step["prompt_tokens"] * price.input + CAP * price.output)
    # Two ids, one text: both get the answer the server gives that text (the first row's).
    first, second = swept["shared"]
    assert all(rec.text[w][first] == rec.text[w][second] for w in rec.text)


def test_eval_charges_a_single_worker_what_the_pipeline_charges_it(swept):
    queries = pq.read_table(swept["queries"])
    ids = set(queries.column("query_id").to_pylist())
    matrix = build_matrix(swept["pool"], queries, ids)
    cost = {(r["question_id"], r["worker"]): r["cost"] for r in matrix.rows.iter_rows(named=True)}
    plans = [p for p in pq.read_table(swept["run"] / "plans.parquet").to_pylist() if p["valid"]]
    paid = _paid(swept["run"])
    singles = [p for p in plans if orjson.loads(p["info_json"])["action"].startswith("single:")]
    long = {(r["question_id"], r["model"]) for r in swept["long"].iter_rows(named=True)}
    checked_long = 0
    for p in singles:
        wid = orjson.loads(p["info_json"])["action"].split(":", 1)[1]
        if p["query_id"] in swept["shared"]:
            continue  # eval takes each id's own row; the server answers the shared text with the first
        assert cost[(p["query_id"], wid)] == pytest.approx(paid[p["plan_id"]], rel=1e-9)
        checked_long += (p["query_id"], swept["pool"].worker(wid).model.split("/", 1)[1]) in long
    assert checked_long >= 3
