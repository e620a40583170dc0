"""Any recorded table, under any name: a user's own logs (math and multiple choice mixed
row by row, real per-row dollars, recorded token counts) go through `conductor replay
queries|pool|serve`, `conductor eval` and `conductor policy rollouts|train|eval` with no
renaming, and every cost comes from the recorded `cost_usd`. Also: the error for each kind
of bad table, and the converter from wide tables (RouterBench's layout)."""

from __future__ import annotations

import asyncio
import json
import sys

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.cli import main as cli_main
from conductor.execute.call import CallRequest, complete
from conductor.grading import grade
from conductor.localserver import start_server
from conductor.pool import load_pool
from conductor.replay.main import READY
from conductor.replay.process import ReplayHandle
from conductor.replay.tables import split_of
from conductor.tokens import tokens_from_chars as estimate_tokens
from tests.conftest import REPLAY

# slow: rollouts, training and evaluation over a replay table
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not REPLAY.is_dir(), reason=f"shared replay data not found at {REPLAY} (set CONDUCTOR_REPLAY_DIR to its folder)")]

NAME = "my_logs_2026"
N_QUESTIONS = 60  # per task
# The user's model names -> the shared tables' models whose answers they recorded (GSM8K, MMLU-Pro).
# Mixtral keeps its own name (it is in prices.csv); alpha, beta and gamma are not in any price table.
SOURCES = {
    "alpha": ("gpt-4o-mini-2024-07-18", "gpt4o-2024-05"),
    "beta": ("Meta-Llama-3.1-8B-Instruct", "Yi-6b-Chat"),
    "gamma": ("gemma-2-2b-it", "Qwen1.5-7B-Chat"),
    "Mixtral-8x7B-Instruct-v0.1": ("Mixtral-8x7B-Instruct-v0.1", "Mixtral-8x7B-Instruct-v0.1"),
}
# What the user really paid, USD per token (input, output): not prices.csv's figures
# (Mixtral's list price is $0.60 / $0.60 per million tokens, three times less).
PAID = {"alpha": (2e-6, 8e-6), "beta": (0.3e-6, 0.3e-6), "gamma": (0.1e-6, 0.4e-6),
        "Mixtral-8x7B-Instruct-v0.1": (1.8e-6, 1.8e-6)}
NO_TOKENS = "gamma"  # its rows record no token counts: usage is estimated for them


def _pick(dataset: str, k: int) -> pl.DataFrame:
    """Rows of the shared table for the first N_QUESTIONS questions that every source model answered."""
    t = pl.read_parquet(REPLAY / f"{dataset}.parquet")
    src = {s[k]: user for user, s in SOURCES.items()}
    t = t.filter(pl.col("model").is_in(list(src)))
    full = t.group_by("question_id").len().filter(pl.col("len") == len(src)).get_column("question_id").to_list()
    ids = t.filter(pl.col("question_id").is_in(full)).get_column("question_id").unique(maintain_order=True)
    t = t.filter(pl.col("question_id").is_in(ids.head(N_QUESTIONS).to_list()))
    return t.with_columns(pl.col("model").replace_strict(src).alias("model"),
                          pl.lit("math" if k == 0 else "choice").alias("task"))


def build_logs() -> pl.DataFrame:
    t = pl.concat([_pick("gsm8k", 0).drop("dataset"),
                   _pick("mmlu_pro", 1).drop("dataset", "category")], how="vertical")
    est_in = estimate_tokens(pl.col("question").str.len_chars())
    est_out = estimate_tokens(pl.col("response").str.len_chars())
    gamma = pl.col("model") == NO_TOKENS
    t = t.with_columns(
        pl.when(gamma).then(None).otherwise(est_in + 5).alias("prompt_tokens"),
        pl.when(gamma).then(None).otherwise(est_out + 3).alias("completion_tokens"),
        pl.col("correct").cast(pl.Int8),  # 0/1 numbers, as many logs store it
    )
    p_in = pl.col("model").replace_strict({m: p[0] for m, p in PAID.items()}, return_dtype=pl.Float64)
    p_out = pl.col("model").replace_strict({m: p[1] for m, p in PAID.items()}, return_dtype=pl.Float64)
    return t.with_columns((pl.col("prompt_tokens").fill_null(est_in) * p_in
                           + pl.col("completion_tokens").fill_null(est_out) * p_out).alias("cost_usd"))


@pytest.fixture(scope="module")
def mine(tmp_path_factory):
    d = tmp_path_factory.mktemp("mine")
    logs = build_logs()
    table = d / f"{NAME}.parquet"
    logs.write_parquet(table)
    files = {"all": d / "queries.parquet", "train": d / "train.parquet", "pool": d / "pool.yaml"}
    for split in ("all", "train"):
        assert cli_main(["replay", "queries", "--table", str(table), "--split", split, "--out", str(files[split]),
                         "--replay-dir", str(REPLAY)]) == 0
    assert cli_main(["replay", "pool", "--table", str(table), "--out", str(files["pool"]),
                     "--replay-dir", str(REPLAY)]) == 0
    # `conductor replay serve`, as a user starts it
    cmd = [sys.executable, "-m", "conductor", "replay", "serve", "--pool", str(files["pool"]), "--port", "0"]
    with start_server(cmd, READY, ReplayHandle, "127.0.0.1", startup_timeout_s=60) as server:
        yield {"dir": d, "table": table, "logs": logs, "server": server, **files}


def _recorded(logs: pl.DataFrame) -> dict[tuple[str, str], dict]:
    return {(r["model"], r["question_id"]): r for r in logs.iter_rows(named=True)}


def test_queries_and_pool_from_a_table_of_any_name(mine):
    logs = mine["logs"]
    q = pq.read_table(mine["all"]).to_pylist()
    tasks = dict(logs.select("question_id", "task").unique().iter_rows())
    assert len(q) == 2 * N_QUESTIONS and {r["task"] for r in q} == {"math", "choice"}
    assert all(r["task"] == tasks[r["query_id"]] for r in q)
    assert {json.loads(r["metadata"])["dataset"] for r in q} == {NAME}
    assert all(split_of(r["query_id"]) == "train" for r in pq.read_table(mine["train"]).to_pylist())

    pool = load_pool(mine["pool"])
    r = pool.replay
    assert (r["dataset"], r["task"], r["table"]) == (NAME, "mixed", str(mine["table"].resolve()))
    assert r["costs"] == f"recorded cost_usd on {logs.height} of {logs.height} rows, else tokens x price"
    train = logs.with_columns(pl.col("question_id").map_elements(split_of, return_dtype=pl.String).alias("split")) \
        .filter(pl.col("split") == "train")
    for w in (w for w in pool.workers if w.kind == "llm"):
        m = w.model.split("/", 1)[1]
        rows = train.filter(pl.col("model") == m)
        # skills per task, from the train split's labels
        assert w.skills == {t: pytest.approx(rows.filter(pl.col("task") == t)["correct"].mean(), abs=1e-4)
                            for t in ("choice", "math")}
        # an effective price from the recorded dollars, not prices.csv (Mixtral's list price is 0.6e-6)
        tokens = (rows["prompt_tokens"].fill_null(0) + rows["completion_tokens"].fill_null(0)).sum()
        if m == NO_TOKENS:
            tokens = sum(round(len(x) / 4) for x in rows["question"]) + sum(round(len(x) / 4) for x in rows["response"])
        rate = rows["cost_usd"].sum() / tokens
        assert w.price.input == w.price.output == pytest.approx(rate, rel=1e-5)
        assert f"real recorded responses from the replay table {NAME}.parquet" in w.description
    mixtral = pool.worker("Mixtral-8x7B-Instruct-v0.1")
    assert mixtral.price.input == pytest.approx(1.8e-6, rel=1e-5)
    assert "effective price" in mine["pool"].read_text()  # the file says how prices were made


def test_the_server_sends_recorded_costs_and_tokens(mine):
    server, logs = mine["server"], mine["logs"]
    for m in ("alpha", NO_TOKENS):
        row = logs.filter(pl.col("model") == m).row(3, named=True)
        resp = asyncio.run(complete(CallRequest(f"openai/{m}", [{"role": "user", "content": row["question"]}],
                                                {"max_tokens": 1024}, server.url, 10.0), "no-key"))
        assert resp.text == row["response"] and resp.cost_usd == pytest.approx(row["cost_usd"], rel=1e-12)
        if m == NO_TOKENS:
            assert resp.usage_estimated and resp.prompt_tokens == round(len(row["question"]) / 4)
        else:
            assert not resp.usage_estimated
            assert (resp.prompt_tokens, resp.completion_tokens) == (row["prompt_tokens"], row["completion_tokens"])


def _policies(path) -> dict:
    return json.loads(path.read_text())


def test_eval_grades_each_task_with_its_own_grader_and_charges_recorded_costs(mine, capsys):
    out = mine["dir"] / "eval"
    assert cli_main(["eval", "--pool", str(mine["pool"]), "--queries", str(mine["all"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{NAME}, split all: {2 * N_QUESTIONS} queries, 4 workers (tasks: choice {N_QUESTIONS}, " \
           f"math {N_QUESTIONS}" in printed
    logs = mine["logs"]
    data = _policies(out / "policies.json")
    assert data["meta"]["task"] == "mixed" and data["meta"]["recorded_cost_rows"] == logs.height
    n = 2 * N_QUESTIONS
    singles = {p["worker"]: p for p in data["policies"] if p["kind"] == "single"}
    for m, p in singles.items():
        rows = logs.filter(pl.col("model") == m)
        # Each row graded with its own task's grader: math for GSM8K rows, choice for MMLU-Pro rows.
        verdicts = [bool(grade(t, r, ref).correct) for t, r, ref in rows.select("task", "response", "reference").iter_rows()]
        assert p["accuracy"] == pytest.approx(sum(verdicts) / n)
        assert p["accuracy_labels"] == pytest.approx(rows["correct"].sum() / n)
        assert p["usd_per_query"] == pytest.approx(rows["cost_usd"].sum() / n, rel=1e-9)  # the recorded dollars
    # Grading a choice row as math (or the reverse) would not agree with the labels this well.
    assert data["meta"]["agreement"] > 0.95
    report = (out / "report.md").read_text()
    assert report.startswith(f"# Evaluation: {NAME}, split all")
    assert "| policy | accuracy (our grader) | ± SE | accuracy (labels) |" in report
    assert f"the recorded `cost_usd` of every row ({logs.height} rows)" in report
    assert f"tasks: choice {N_QUESTIONS}, math {N_QUESTIONS}" in report
    # The planner, through the pipeline against the replay server: run id and costs.
    run = out / "planner-run" / "runs" / f"eval-{NAME}-all"
    assert f"eval-{NAME}-all" in report
    _check_run(run, mine)


def _check_run(run, mine) -> None:
    """Every paid step cost its recorded cost_usd; every plan graded with its query's task."""
    rec = _recorded(mine["logs"])
    traces = pq.read_table(run / "traces.parquet").to_pylist()
    models = [t for t in traces if t["worker"] not in ("vote", "extract")]
    # Every model step was served; a cascade's escalation may be skipped (the cheap answers agreed).
    assert models and all(t["status"] == "ok" or (t["status"] == "skipped" and "condition" in t["error"])
                          for t in models)
    paid = [t for t in models if t["status"] == "ok"]
    for t in paid:
        row = rec[(t["model"].split("/", 1)[1], t["query_id"])]
        # What the answer cost when paid for; a plan answered from the cache pays nothing again.
        assert t["original_cost_usd"] == pytest.approx(row["cost_usd"], rel=1e-12)
        assert t["cost_usd"] == (0.0 if t["cache_hit"] else pytest.approx(row["cost_usd"], rel=1e-12))
        assert t["usage_estimated"] == (row["model"] == NO_TOKENS)
        if row["model"] == "alpha":  # input and output prices differ: tokens x the pool's price would not match
            price = load_pool(mine["pool"]).worker("alpha").price
            assert t["cost_usd"] != pytest.approx(t["prompt_tokens"] * price.input
                                                  + t["completion_tokens"] * price.output, rel=1e-6)
    results = {r["plan_id"]: r for r in pq.read_table(run / "results.parquet").to_pylist()}
    by_plan = {}
    for t in traces:
        by_plan[t["plan_id"]] = by_plan.get(t["plan_id"], 0.0) + (t["cost_usd"] or 0.0)  # a failed vote: None
    assert all(results[p]["cost_usd"] == pytest.approx(c) for p, c in by_plan.items())
    tasks = {r["query_id"]: (r["task"], r["reference"]) for r in pq.read_table(mine["all"]).to_pylist()}
    rewards = pq.read_table(run / "rewards.parquet").to_pylist()
    assert {r["task"] for r in rewards} == {"math", "choice"}
    for r in rewards:
        task, ref = tasks[r["query_id"]]
        assert r["task"] == task
        assert r["correct"] == grade(task, results[r["plan_id"]]["final_answer"], ref).correct


def test_policy_rollouts_train_and_eval_on_the_mixed_table(mine, monkeypatch, capsys):
    monkeypatch.setenv("CONDUCTOR_REPLAY_URL", mine["server"].url)  # the `replay serve` started above
    d = mine["dir"]
    data, root = d / "data", d / "policy"
    assert cli_main(["policy", "rollouts", str(mine["train"]), "--pool", str(mine["pool"]), "-k", "all",
                     "--run-id", "roll-0", "--data-dir", str(data), "--policy", "none", "--quiet"]) == 0
    _check_run(data / "runs" / "roll-0", mine)
    plans = pq.read_table(data / "runs" / "roll-0" / "plans.parquet").to_pylist()
    assert {p["task"] for p in plans} == {"math", "choice"}
    # A sweep: every candidate action once per query, cascades among them.
    actions = [orjson.loads(p["info_json"]).get("action") for p in plans if p["valid"]]
    assert any(a.startswith("cascade:") for a in actions) and len(set(actions)) > 8
    assert cli_main(["policy", "train", "--pool", str(mine["pool"]), "--runs", "roll-0", "--data-dir", str(data),
                     "--out", str(root), "--lambda", "100"]) == 0
    artifact = next(root.glob("*/v0001"))
    meta = orjson.loads((artifact / "policy.json").read_bytes())
    assert set(meta["actions"]["by_task"]) == {"math", "choice"}  # an action set per task
    capsys.readouterr()
    assert cli_main(["policy", "eval", "--pool", str(mine["pool"]), "--queries", str(mine["all"]),
                     "--policies", str(d / "nope"), "--out", str(d / "nope-eval")]) == 2
    assert f"--policies {d / 'nope'}: no policy artifact there" in capsys.readouterr().err
    assert not (d / "nope-eval").exists()  # refused before the planner's run
    out = d / "policy-eval"
    assert cli_main(["policy", "eval", "--pool", str(mine["pool"]), "--queries", str(mine["all"]),
                     "--policies", str(artifact), "--out", str(out), "--no-planner",
                     "--target", "-0.01:0.15"]) == 0  # as the help writes it: a value starting with "-"
    assert f"{NAME}, split test:" in capsys.readouterr().out
    [target] = _policies(out / "policies.json")["meta"]["targets"]
    assert target["name"] == "accuracy >= best single -0.010 at <= 15% of its cost" and target["met"] is not None
    rows = _policies(out / "policies.json")["policies"]
    learned = [p for p in rows if p["kind"] == "learned"]
    assert len(learned) == 1 and learned[0]["accuracy"] is not None and learned[0]["se"] is not None
    fixed = [p for p in rows if p["kind"] == "fixed"]
    assert len(fixed) == 1 and set(fixed[0]["info"]["choice"]) == {"math", "choice"}
    assert sum(bool(p["info"]["shipped"]) for p in learned + fixed) == 1
    run = out / "learned-run-0" / "runs" / f"eval-{NAME}-test-learned-0"
    test_ids = [q for q in pq.read_table(mine["all"]).column("query_id").to_pylist() if split_of(q) == "test"]
    assert pq.read_table(run / "results.parquet").num_rows == len(test_ids)
    _check_run(run, mine)

    # Per group of a metadata field: the report names the grouping, each plan records its query's group.
    assert cli_main(["policy", "train", "--pool", str(mine["pool"]), "--runs", "roll-0", "--data-dir", str(data),
                     "--out", str(d / "policy-seg"), "--floor", "0", "--learner", "segment",
                     "--group-by", "dataset"]) == 0
    seg = next((d / "policy-seg").glob("*/v0001"))
    assert cli_main(["policy", "eval", "--pool", str(mine["pool"]), "--queries", str(mine["all"]),
                     "--policies", str(seg), "--out", str(d / "seg-eval"), "--no-planner"]) == 0
    [row] = [p for p in _policies(d / "seg-eval" / "policies.json")["policies"] if p["kind"] == "learned"]
    assert row["name"].startswith("learned policy, floor +0") and "(segment by dataset v0001)" in row["name"]
    run = d / "seg-eval" / "learned-run-0" / "runs" / f"eval-{NAME}-test-learned-0"
    groups = {orjson.loads(p["info_json"])["group"] for p in pq.read_table(run / "plans.parquet").to_pylist()}
    assert groups == {NAME}


def test_rollouts_of_questions_the_pool_never_recorded_are_refused(mine, tmp_path, capsys):
    queries = pq.read_table(mine["train"]).slice(0, 3).to_pylist()
    queries[1]["prompt"] = "What is the capital of France?"
    other = tmp_path / "other.parquet"
    pq.write_table(pa.Table.from_pylist(queries), other)
    data = tmp_path / "data"
    assert cli_main(["policy", "rollouts", str(other), "--pool", str(mine["pool"]), "-k", "2",
                     "--data-dir", str(data), "--policy", "none", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"1 of 3 queries are not questions the replay pool {mine['pool']} recorded" in err
    assert queries[1]["query_id"] in err and not data.exists()


def test_rollouts_with_no_server_say_so_once_and_how_to_start_it(mine, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CONDUCTOR_REPLAY_URL", "http://127.0.0.1:9/v1")  # nothing listens there
    assert cli_main(["policy", "rollouts", str(mine["train"]), "--pool", str(mine["pool"]), "-k", "2",
                     "--data-dir", str(tmp_path / "data"), "--policy", "none", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("cannot reach http://127.0.0.1:9/v1") == 1, err  # one line for the endpoint, not per worker
    assert f"conductor replay serve --pool {mine['pool']}" in err and "--serve" in err


def test_budgets_settle_the_recorded_cost(mine, tmp_path, monkeypatch):
    """Under a budget each call reserves with the pool's (effective) price and settles at its recorded cost."""
    monkeypatch.setenv("CONDUCTOR_REPLAY_URL", mine["server"].url)
    queries = tmp_path / "q.parquet"
    pq.write_table(pq.read_table(mine["all"]).slice(0, 12), queries)
    assert cli_main(["run", str(queries), "--pool", str(mine["pool"]), "--budget", "1.0", "--run-id", "budgeted",
                     "--data-dir", str(tmp_path / "data"), "--no-cache"]) == 0
    run = tmp_path / "data" / "runs" / "budgeted"
    traces = pq.read_table(run / "traces.parquet").to_pylist()
    rec = _recorded(mine["logs"])
    paid = sum(rec[(t["model"].split("/", 1)[1], t["query_id"])]["cost_usd"] for t in traces if t["attempts"])
    spend = {c["cap"]: c["spent_usd"] for c in json.loads((run / "summary.json").read_text())["spend"]}
    assert paid > 0 and spend["run"] == spend["provider replay"] == pytest.approx(paid, abs=1e-6)


# ---------------------------------------------------------------- bad tables: one clear error each


def _small(tmp_path, name="logs.parquet", **change) -> tuple:
    """A small valid table (two models, GSM8K) written under `name`, with columns changed."""
    t = pl.read_parquet(REPLAY / "gsm8k.parquet").filter(
        pl.col("model").is_in(["gpt-4o-mini-2024-07-18", "gemma-2-2b-it"])).drop("dataset")
    t = t.filter(pl.col("question_id").is_in(t["question_id"].unique(maintain_order=True).head(20).to_list()))
    for col, value in change.items():
        t = t.drop(col) if value is None else t.with_columns(value.alias(col))
    path = tmp_path / name
    t.write_parquet(path)
    return path, t


def _pool_error(path, capsys, *extra) -> str:
    out = path.parent / "pool.yaml"
    assert cli_main(["replay", "pool", "--table", str(path), "--out", str(out), "--replay-dir", str(REPLAY),
                     *extra]) == 2
    assert not out.exists()
    return capsys.readouterr().err


def test_a_missing_column_is_named_with_the_file(tmp_path, capsys):
    path, _ = _small(tmp_path, response=None)
    err = _pool_error(path, capsys)
    assert f"replay table {path.resolve()}: missing column(s) response" in err
    assert cli_main(["replay", "queries", "--table", str(tmp_path / "nowhere.parquet"),
                     "--out", str(tmp_path / "q.parquet")]) == 2
    assert "--table" in capsys.readouterr().err


def test_an_empty_table_is_refused_and_nothing_is_written(tmp_path, capsys):
    """A table with the columns and no rows made a pool of '0 recorded models' and a query set
    of no queries, refused later under the output's name, not the table's."""
    path, t = _small(tmp_path)
    empty = tmp_path / "empty.parquet"
    t.head(0).write_parquet(empty)
    for cmd, out in (("queries", "q.parquet"), ("pool", "p.yaml")):
        assert cli_main(["replay", cmd, "--table", str(empty), "--task", "math", "--out", str(tmp_path / out),
                         "--replay-dir", str(REPLAY)][:None if cmd == "pool" else -2]) == 2
        assert f"replay table {empty.resolve()}: has no rows" in capsys.readouterr().err
        assert not (tmp_path / out).exists()
    assert cli_main(["replay", "queries", "--table", str(path), "--task", "math", "--split", "test",
                     "--out", str(tmp_path / "q.parquet")]) == 0  # a table of some rows still splits


def test_rows_without_a_task_are_named_and_take_task_when_given(tmp_path, capsys):
    ids = pl.read_parquet(REPLAY / "gsm8k.parquet", columns=["question_id"])["question_id"].unique(
        maintain_order=True).head(20).to_list()
    task = pl.when(pl.col("question_id").is_in(ids[:2])).then(None).otherwise(pl.lit("math"))
    path, _ = _small(tmp_path, task=task)
    err = _pool_error(path, capsys)
    assert "no task for question id(s)" in err and ids[0] in err and ids[1] in err and ids[2] not in err
    assert cli_main(["replay", "pool", "--table", str(path), "--task", "math", "--out", str(tmp_path / "p.yaml"),
                     "--replay-dir", str(REPLAY)]) == 0
    assert load_pool(tmp_path / "p.yaml").replay["task"] == "math"


def test_an_unknown_task_is_named(tmp_path, capsys):
    path, t = _small(tmp_path, task=pl.lit("algebra"))
    err = _pool_error(path, capsys)
    assert "column 'task' has unknown value(s) 'algebra' for question id(s)" in err
    assert "allowed: math, choice, exact, literal, code" in err
    ok, _ = _small(tmp_path, name="lit.parquet", task=pl.lit("literal"))  # the newer graders' tasks are accepted
    assert cli_main(["replay", "pool", "--table", str(ok), "--out", str(tmp_path / "p.yaml"),
                     "--replay-dir", str(REPLAY)]) == 0
    assert load_pool(tmp_path / "p.yaml").replay["task"] == "literal"


def test_a_model_without_price_is_named_unless_its_rows_record_cost(tmp_path, capsys):
    renamed = pl.col("model").str.replace("gemma-2-2b-it", "my-own-finetune", literal=True)
    path, _ = _small(tmp_path, model=renamed)
    err = _pool_error(path, capsys, "--task", "math")
    assert "no price for model(s) my-own-finetune" in err and "gpt-4o-mini" not in err.split("no price")[1][:40]
    costed, _ = _small(tmp_path, name="costed.parquet", model=renamed,
                       cost_usd=pl.when(pl.col("model") == "my-own-finetune").then(pl.lit(0.0001)))
    assert cli_main(["replay", "pool", "--table", str(costed), "--task", "math", "--out", str(tmp_path / "p.yaml"),
                     "--replay-dir", str(REPLAY)]) == 0
    pool = load_pool(tmp_path / "p.yaml")
    assert pool.worker("gpt-4o-mini-2024-07-18").price.input == pytest.approx(0.15e-6)  # list price, no costs
    assert pool.worker("my-own-finetune").price.input > 0


def test_eval_on_test_with_no_train_questions_says_so(tmp_path, capsys):
    """The best single is chosen on train: with no train question it cannot be, and is not
    chosen on nothing."""
    path, t = _small(tmp_path)
    t.filter(pl.col("question_id").map_elements(split_of, return_dtype=pl.String) == "test").write_parquet(path)
    pool, queries = tmp_path / "pool.yaml", tmp_path / "q.parquet"
    assert cli_main(["replay", "pool", "--table", str(path), "--out", str(pool), "--replay-dir", str(REPLAY),
                     "--task", "math"]) == 0
    assert cli_main(["replay", "queries", "--table", str(path), "--out", str(queries), "--replay-dir", str(REPLAY),
                     "--task", "math"]) == 0
    capsys.readouterr()
    assert cli_main(["eval", "--pool", str(pool), "--queries", str(queries), "--split", "test",
                     "--out", str(tmp_path / "eval")]) == 2
    assert "has no train questions, so the best single cannot be chosen on train" in capsys.readouterr().err


def test_a_pool_that_would_not_load_is_not_written_over_a_good_one(tmp_path, capsys):
    path, _ = _small(tmp_path)
    out = tmp_path / "pool.yaml"
    assert cli_main(["replay", "pool", "--table", str(path), "--out", str(out), "--replay-dir", str(REPLAY),
                     "--task", "math"]) == 0
    good = out.read_text()
    assert cli_main(["replay", "pool", "--table", str(path), "--out", str(out), "--replay-dir", str(REPLAY),
                     "--task", "math", "--api-base", "notaurl"]) == 2
    assert "not written, the pool would not load" in capsys.readouterr().err and out.read_text() == good


def test_rows_the_server_would_drop_are_refused(tmp_path, capsys):
    """A repeated (question_id, model) pair or an id naming two texts: one row of them would be
    served and evaluated, while the pool's skills counted all."""
    path, t = _small(tmp_path)
    qid = t["question_id"][0]
    pl.concat([t, t.head(1)]).write_parquet(path)
    assert (f"2 rows repeat a (question_id, model) pair, e.g. question id(s) {qid}; keep one answer per model "
            f"and question") in _pool_error(path, capsys, "--task", "math")
    t.with_columns(pl.when((pl.col("question_id") == qid) & (pl.col("model") == t["model"][0]))
                   .then(pl.lit("Another question?")).otherwise(pl.col("question")).alias("question")
                   ).write_parquet(path)
    assert f"question id(s) {qid} name more than one question text" in _pool_error(path, capsys, "--task", "math")


@pytest.mark.parametrize("value, words", [
    (pl.when(pl.col("correct")).then(pl.lit("yes")).otherwise(pl.lit("no")),
     "column 'correct' must hold booleans or 0/1 numbers, not String"),
    (pl.col("correct").cast(pl.Int64) * 2, "column 'correct' must hold booleans or 0/1 numbers; other values"),
])
def test_a_mistyped_correct_column_is_named(tmp_path, capsys, value, words):
    path, _ = _small(tmp_path, correct=value)
    assert words in _pool_error(path, capsys, "--task", "math")


def test_bad_optional_columns_and_names_are_refused(tmp_path, capsys):
    path, _ = _small(tmp_path, cost_usd=pl.lit("cheap"))
    assert "column 'cost_usd' must hold numbers, not String" in _pool_error(path, capsys)
    path, _ = _small(tmp_path, name="neg.parquet", cost_usd=pl.lit(-1.0))
    assert "column 'cost_usd' must hold USD amounts of one call: finite numbers from 0 to 10,000" in _pool_error(path, capsys)
    path, _ = _small(tmp_path, name="ok.parquet")
    assert "--name 'my logs'" in _pool_error(path, capsys, "--task", "math", "--name", "my logs")


# ---------------------------------------------------------------- wide tables (RouterBench's layout)


ROUTERBENCH_MODELS = {"openai/gpt-4o-mini": "gpt-4o-mini-2024-07-18", "meta/llama-3-8b": "Meta-Llama-3.1-8B-Instruct",
                      "google/gemma-2b": "gemma-2-2b-it"}


def _wide(tmp_path, scores: str = "binary"):
    """A wide table in RouterBench's layout from 30 GSM8K questions: no reference column."""
    t = pl.read_parquet(REPLAY / "gsm8k.parquet").filter(pl.col("model").is_in(list(ROUTERBENCH_MODELS.values())))
    ids = t["question_id"].unique(maintain_order=True).head(30).to_list()
    base = t.filter(pl.col("question_id").is_in(ids)).unique(subset=["question_id"], maintain_order=True)
    wide = pl.DataFrame({"sample_id": [f"grade-school-math.{i}" for i in range(len(ids))],
                         "prompt": base["question"], "eval_name": ["grade-school-math"] * len(ids),
                         "oracle_model_to_route_to": ["google/gemma-2b"] * len(ids)})
    for name, model in ROUTERBENCH_MODELS.items():
        rows = t.filter(pl.col("model") == model).select("question_id", "response", "correct")
        rows = pl.DataFrame({"question_id": ids}).join(rows, on="question_id", how="left", maintain_order="left")
        score = rows["correct"].cast(pl.Float64)
        if scores == "fractional":
            score = score * 0.8 + 0.1
        wide = wide.with_columns(score.alias(name), rows["response"].alias(f"{name}|model_response"),
                                 pl.Series(f"{name}|total_cost", [0.0001 * (i + 1) for i in range(len(ids))]))
    path = tmp_path / "routerbench_0shot.parquet"
    wide.write_parquet(path)
    return path, wide


def test_convert_a_routerbench_wide_table_and_evaluate_it_by_its_labels(tmp_path, capsys):
    wide_path, wide = _wide(tmp_path)
    long = tmp_path / "routerbench.parquet"
    assert cli_main(["replay", "convert", "--wide", str(wide_path), "--out", str(long),
                     "--task-map", "grade-school-math=math"]) == 0
    assert "90 rows: 30 questions x 3 models; cost_usd on 90 rows" in capsys.readouterr().out
    t = pl.read_parquet(long)
    assert t.columns == ["question_id", "question", "reference", "model", "response", "correct", "score",
                         "cost_usd", "category", "task"]
    first = t.row(0, named=True)
    assert first["question_id"] == "grade-school-math.0" and first["reference"] is None
    assert first["model"] == "openai/gpt-4o-mini" and first["task"] == "math" and first["category"] == "grade-school-math"
    w = wide.row(0, named=True)
    assert first["response"] == w["openai/gpt-4o-mini|model_response"]
    assert first["correct"] == (w["openai/gpt-4o-mini"] == 1.0) and first["cost_usd"] == 0.0001
    # No reference: `correct` comes from the score; the evaluation says its figures come from the labels.
    pool, queries = tmp_path / "pool.yaml", tmp_path / "q.parquet"
    assert cli_main(["replay", "pool", "--table", str(long), "--out", str(pool), "--replay-dir", str(REPLAY)]) == 0
    assert load_pool(pool).worker("openai_gpt-4o-mini").model == "openai/openai/gpt-4o-mini"
    assert cli_main(["replay", "queries", "--table", str(long), "--out", str(queries)]) == 0
    out = tmp_path / "eval"
    assert cli_main(["eval", "--pool", str(pool), "--queries", str(queries), "--out", str(out), "--no-planner"]) == 0
    data = _policies(out / "policies.json")
    assert data["meta"]["graded_queries"] == 0 and data["meta"]["agreement"] is None
    assert all(p["accuracy"] is None for p in data["policies"])  # nothing for our grader to judge
    assert not any(p["info"].get("chosen_by") == "grader" or p["info"].get("correct_by") == "grader"
                   for p in data["policies"])
    best = next(p for p in data["policies"] if p["kind"] == "best_single")
    labels = t.group_by("model").agg(pl.col("correct").sum())
    assert best["accuracy_labels"] == pytest.approx(labels["correct"].max() / 30)
    report = (out / "report.md").read_text()
    assert "no query has a reference" in report and "every figure here comes from the recorded labels" in report
    oracle = next(p for p in data["policies"] if p["kind"] == "oracle")
    assert oracle["name"] == "oracle (labels)" and oracle["usd_per_query"] > 0


def test_convert_needs_a_threshold_for_fractional_scores(tmp_path, capsys):
    wide_path, _ = _wide(tmp_path, scores="fractional")
    long = tmp_path / "long.parquet"
    assert cli_main(["replay", "convert", "--wide", str(wide_path), "--out", str(long)]) == 2
    assert "scores strictly between 0 and 1 in column(s) openai/gpt-4o-mini" in capsys.readouterr().err
    assert cli_main(["replay", "convert", "--wide", str(wide_path), "--out", str(long), "--threshold", "0.5",
                     "--task", "math"]) == 0
    t = pl.read_parquet(long)
    assert t.filter(pl.col("score") == 0.9)["correct"].all() and not t.filter(pl.col("score") == 0.1)["correct"].any()
    assert cli_main(["replay", "convert", "--wide", str(wide_path), "--out", str(long), "--id-column", "id"]) == 2
    assert "no column 'id' (--id-column)" in capsys.readouterr().err
    assert cli_main(["replay", "convert", "--wide", str(wide_path), "--out", str(long), "--threshold", "nan",
                     "--task", "math"]) == 2  # every score >= NaN is false: every answer would be wrong
    assert "--threshold must be a finite number (got nan)" in capsys.readouterr().err
    # A NaN score (polars counts NaN as above any cut: 'correct') or one out of 0..1 is named.
    name = next(iter(ROUTERBENCH_MODELS))
    for bad in (float("nan"), 2.0, -1.0):
        pl.read_parquet(wide_path).with_columns(pl.lit(bad).alias(name)).write_parquet(tmp_path / "bad.parquet")
        assert cli_main(["replay", "convert", "--wide", str(tmp_path / "bad.parquet"), "--out", str(long),
                         "--threshold", "0.5"]) == 2
        assert f"column {name!r} must hold a score from 0 to 1; found {bad}" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["nan:0.15", "0:nan", "0:inf", "0:0", "0.15"])
def test_an_eval_target_that_is_no_pair_of_finite_numbers_is_refused(text):
    from conductor.errors import ConductorError
    from conductor.evaluation import Target

    with pytest.raises(ConductorError, match=f"--target '{text}'"):
        Target.parse(text)
    assert Target.parse("-0.01:0.15").cost_share == 0.15


def test_wide_pickles_get_a_recipe_instead_of_a_crash(tmp_path, capsys):
    pkl = tmp_path / "routerbench_0shot.pkl"
    pkl.write_bytes(b"\x80\x04.")
    assert cli_main(["replay", "convert", "--wide", str(pkl), "--out", str(tmp_path / "x.parquet")]) == 2
    assert "pd.read_pickle" in capsys.readouterr().err


def test_unusual_answers_and_text_run_to_the_end(tmp_path):
    """A 40-digit answer, empty and null responses, NUL, combining marks, RTL marks and
    replacement characters: the server serves them, `conductor eval` (planner included)
    runs to the end and grades what can be graded."""
    big = "1234567890123456789012345678901234567890"
    odd = [
        ("q-big", "What is 10^39 + 234567890123456789012345678901234567890?", big, f"Answer: {big}", "math"),
        ("q-empty", "How many legs has a spider?", "8", "", "math"),
        ("q-null", "How many days has a week?", "7", None, "math"),
        ("q-nul", "Pick one.\x00 (A) yes (B) no", "A", "Answer: A\x00", "choice"),
        ("q-comb", "Name the cafe\u0301 in Paris.", "cafe\u0301", "Answer: cafe\u0301", "exact"),
        ("q-rtl", "\u200fמה השעה?\u200f (A) 1 (B) 2", "B", "\u200fAnswer: (B)\u200f", "choice"),
        ("q-repl", "Decode \ufffd\ufffd.", "\ufffd", "Answer: \ufffd", "exact"),
    ]
    rows = []
    for qid, question, ref, response, task in odd:
        for model in ("gpt-4o-mini-2024-07-18", "gemma-2-2b-it"):
            rows.append({"question_id": qid, "question": question, "reference": ref, "model": model,
                         "response": response, "correct": model.startswith("gpt"), "task": task})
    table = tmp_path / "odd.parquet"
    pl.DataFrame(rows, schema_overrides={"response": pl.String}).write_parquet(table)
    pool, queries = tmp_path / "pool.yaml", tmp_path / "q.parquet"
    assert cli_main(["replay", "pool", "--table", str(table), "--out", str(pool), "--replay-dir", str(REPLAY)]) == 0
    assert cli_main(["replay", "queries", "--table", str(table), "--out", str(queries)]) == 0
    assert yaml.safe_load(pool.read_text())["replay"]["task"] == "mixed"
    out = tmp_path / "eval"
    assert cli_main(["eval", "--pool", str(pool), "--queries", str(queries), "--out", str(out),
                     "--planner-option", "cost_weight=0"]) == 0
    data = _policies(out / "policies.json")
    assert data["meta"]["queries"] == len(odd) and data["meta"]["planner"]["valid_plans"] == len(odd)
    assert data["meta"]["planner"]["server_outcomes"].keys() == {"recorded"}  # every odd question was served
    results = pq.read_table(out / "planner-run" / "runs" / "eval-odd-all" / "results.parquet").to_pylist()
    assert len(results) == len(odd) and {r["status"] for r in results} == {"ok"}
    # `conductor graders check` on the same table, and on a CSV export of it whose bytes are not
    # all valid UTF-8 (as logs dumped by other tools can be): both run to the end.
    assert cli_main(["graders", "check", "--table", str(table), "--examples", "10"]) == 0
    csv_path = tmp_path / "odd.csv"
    pl.read_parquet(table).write_csv(csv_path)
    raw = csv_path.read_bytes().replace(b"Answer: 8", b"Answer: 8").replace(b"Decode", b"Decode \xff\xfe\xc3(")
    csv_path.write_bytes(raw)
    assert cli_main(["graders", "check", "--table", str(csv_path)]) == 0


def test_graders_check_leaves_out_unlabelled_rows_and_refuses_a_table_with_none(tmp_path, capsys):
    """A missing label is no evidence: it used to count as `wrong` and fill the report with
    'grader correct, label wrong'; a table with no labelled row used to report 0.00% and exit 0."""
    rows = {"response": ["Answer: 4", "Answer: 5", "Answer: 6"], "reference": ["4", "5", "7"],
            "correct": [True, None, False]}
    table = tmp_path / "some.parquet"
    pl.DataFrame(rows).write_parquet(table)
    assert cli_main(["graders", "check", "--table", str(table), "--task", "math"]) == 0
    out = capsys.readouterr().out
    assert "2 rows (1 unlabelled row(s) left out), agreement 100.00%, 0 disagreement(s)" in out, out
    for height in (0, 3):
        pl.DataFrame({**{k: v[:height] for k, v in rows.items()}, "correct": [None] * height},
                     schema={"response": pl.String, "reference": pl.String, "correct": pl.Boolean}
                     ).write_parquet(table)
        assert cli_main(["graders", "check", "--table", str(table), "--task", "math"]) == 2
        assert f"no row has a label in column 'correct' ({height} row(s))" in capsys.readouterr().err


def test_a_second_eval_into_the_same_folder_is_refused_while_the_first_runs(tmp_path, capsys):
    """Both would run their planners into one folder and overwrite each other's report."""
    import fcntl
    import os

    path, _ = _small(tmp_path)
    pool, queries, out = tmp_path / "pool.yaml", tmp_path / "q.parquet", tmp_path / "eval"
    for what, dest in (("pool", pool), ("queries", queries)):
        assert cli_main(["replay", what, "--table", str(path), "--out", str(dest), "--replay-dir", str(REPLAY),
                         "--task", "math"]) == 0
    out.mkdir()
    fd = os.open(out / "lock", os.O_RDWR | os.O_CREAT)  # the first evaluation's hold on the folder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242")
        capsys.readouterr()
        assert cli_main(["eval", "--pool", str(pool), "--queries", str(queries), "--no-planner",
                         "--out", str(out)]) == 2
        assert f"run of eval into {out} is already running in process 4242" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == ["lock"]
    finally:
        os.close(fd)
    assert cli_main(["eval", "--pool", str(pool), "--queries", str(queries), "--no-planner", "--out", str(out)]) == 0
    assert (out / "report.md").is_file()
