"""A user's own recorded table, as users make them (audit 34): missing labels, one question
text under two ids, `--out` naming an input, recorded costs above the reservation, a bad
table after a good one, tables without gold answers, CSV and spreadsheet price tables, and
wide tables with holes. Each is refused with the file, line or ids named, or handled and
said; none loses data or is silently scored. Synthetic tables only: no shared data needed."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import polars as pl
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.cli import main as cli_main
from conductor.pool import load_pool
from conductor.replay.tables import split_of

N = 40
MODELS = ("m-good", "m-bad", "m-mid")


def _table(n: int = N, **change) -> pl.DataFrame:
    """n math questions answered by three models (right, wrong, right on even ids), costs recorded."""
    rows = []
    for i in range(n):
        for m in MODELS:
            right = m == "m-good" or (m == "m-mid" and i % 2 == 0)
            rows.append({"question_id": f"q{i}", "question": f"What is {i} plus {i}?", "reference": str(2 * i),
                         "model": m, "response": f"The answer is {2 * i if right else 2 * i + 1}.",
                         "correct": right, "cost_usd": 0.001, "task": "math"})
    t = pl.DataFrame(rows)
    for col, value in change.items():
        t = t.with_columns(value.alias(col))
    return t


def _write(tmp_path, t: pl.DataFrame, name: str = "mine.parquet"):
    path = tmp_path / name
    t.write_parquet(path)
    return path


def _replay(*args: str, tmp_path) -> int:
    """`conductor replay ...` with an empty replay folder: no shared price table is picked up."""
    return cli_main(["replay", *args, "--replay-dir", str(tmp_path)])


def _pool_and_queries(tmp_path, table) -> tuple:
    pool, queries = tmp_path / "pool.yaml", tmp_path / "q.parquet"
    assert _replay("pool", "--table", str(table), "--out", str(pool), tmp_path=tmp_path) == 0
    assert _replay("queries", "--table", str(table), "--out", str(queries), tmp_path=tmp_path) == 0
    return pool, queries


# ---------------------------------------------------------------- F1: a missing label is not "wrong"


def test_pool_skills_leave_unlabelled_rows_out_and_say_how_many(tmp_path, capsys):
    train = [f"q{i}" for i in range(N) if split_of(f"q{i}") == "train"]
    # m-good is right everywhere: with its labels missing on half its train rows it is still 1.0, not 0.5.
    blank = pl.col("model").eq("m-good") & pl.col("question_id").is_in(train[::2])
    table = _write(tmp_path, _table(correct=pl.when(blank).then(None).otherwise(pl.col("correct"))))
    pool = tmp_path / "pool.yaml"
    assert _replay("pool", "--table", str(table), "--out", str(pool), tmp_path=tmp_path) == 0
    left = len(train[::2])
    assert f"skills: train split, recorded correct labels, per task; {left} train row(s) with no label left out" \
        in capsys.readouterr().out
    loaded = load_pool(pool)
    assert loaded.worker("m-good").skill("math") == 1.0
    assert f"math 1.000 over {len(train) - left}" in loaded.worker("m-good").description
    # No label at all: the skill is unknown (null), as for a model with no train rows, never 0.
    table = _write(tmp_path, _table(correct=pl.lit(None, pl.Boolean)), "nolabels.parquet")
    assert _replay("pool", "--table", str(table), "--out", str(pool), tmp_path=tmp_path) == 0
    assert all(w.skills == {"math": None} for w in load_pool(pool).workers if w.kind == "llm")


def test_eval_judges_by_the_labels_only_the_queries_whose_rows_all_have_one(tmp_path, capsys):
    # q0..q4: m-good's label missing (it answered right). The labels' figures are over the 35 others.
    blank = pl.col("model").eq("m-good") & pl.col("question_id").is_in([f"q{i}" for i in range(5)])
    table = _write(tmp_path, _table(correct=pl.when(blank).then(None).otherwise(pl.col("correct"))))
    pool, queries = _pool_and_queries(tmp_path, table)
    capsys.readouterr()
    assert cli_main(["eval", "--no-planner", "--pool", str(pool), "--queries", str(queries),
                     "--out", str(tmp_path / "ev")]) == 0
    out = capsys.readouterr().out
    assert "grader agrees with the labels on 100.0% of 105 rows" in out
    assert "5 row(s) with no label: 5 queries left out of accuracy (labels)" in out
    data = json.loads((tmp_path / "ev" / "policies.json").read_text())
    assert data["meta"]["labelled_queries"] == 35 and data["meta"]["agreement"] == 1.0
    by = {p["name"]: p for p in data["policies"]}
    assert by["m-good"]["accuracy_labels"] == 1.0 and by["m-good"]["accuracy"] == 1.0
    assert by["m-mid"]["accuracy_labels"] == pytest.approx(17 / 35)  # q5..q39: 18 odd, 17 even
    assert by["oracle (labels)"]["accuracy_labels"] == 1.0
    # and the 5 are left out of all its figures: they counted as wrong by our grader, free and without a call
    oracle = by["oracle (labels)"]
    assert (oracle["accuracy"], oracle["calls_per_query"], oracle["queries"]) == (1.0, 1.0, 35), oracle
    assert by["best single (labels): m-good"]["accuracy_labels"] == 1.0
    report = (tmp_path / "ev" / "report.md").read_text()
    assert "over the 35 of the 40 queries whose rows all have one" in report
    assert "5 row(s) have no label: their 5 queries are left out of it, never counted as wrong" in report


def test_eval_without_any_label_has_no_figures_by_the_labels_and_without_references_too_is_refused(tmp_path, capsys):
    table = _write(tmp_path, _table(correct=pl.lit(None, pl.Boolean)))
    pool, queries = _pool_and_queries(tmp_path, table)
    assert cli_main(["eval", "--no-planner", "--pool", str(pool), "--queries", str(queries),
                     "--out", str(tmp_path / "ev")]) == 0
    data = json.loads((tmp_path / "ev" / "policies.json").read_text())
    assert all(p["accuracy_labels"] is None for p in data["policies"])
    assert not any("labels" in p["name"] for p in data["policies"])  # nothing chosen by absent labels
    assert {p["name"] for p in data["policies"] if p["kind"] == "best_single"} == {"best single (our grader): m-good"}
    assert "there is no *accuracy (labels)*" in (tmp_path / "ev" / "report.md").read_text()
    table = _write(tmp_path, _table(correct=pl.lit(None, pl.Boolean), reference=pl.lit(None, pl.String)), "bare.parquet")
    pool, queries = _pool_and_queries(tmp_path, table)
    capsys.readouterr()
    assert cli_main(["eval", "--no-planner", "--pool", str(pool), "--queries", str(queries),
                     "--out", str(tmp_path / "ev2")]) == 2
    assert "nothing to judge the answers by: no query has a reference" in capsys.readouterr().err


# ---------------------------------------------------------------- F3, F5: inputs and good files are never lost


@pytest.mark.parametrize("action", ["queries", "pool", "convert"])
def test_out_that_is_an_input_is_refused_and_the_input_kept(tmp_path, capsys, action):
    if action == "convert":
        src = _write(tmp_path, pl.DataFrame({"sample_id": ["s0"], "prompt": ["1+1?"], "eval_name": ["gsm"],
                                             "A": [1.0], "A|model_response": ["2"]}), "wide.parquet")
        args = ["convert", "--wide", str(src), "--out", str(tmp_path / "." / "wide.parquet")]
    else:
        src = _write(tmp_path, _table())
        args = [action, "--table", str(src), "--out", str(tmp_path / "sub" / ".." / "mine.parquet")]
        (tmp_path / "sub").mkdir()
    before = src.read_bytes()
    assert (cli_main(["replay", *args]) if action == "convert" else _replay(*args, tmp_path=tmp_path)) == 2
    flag = "--wide" if action == "convert" else "--table"
    assert f"is the same file as {flag} {src}" in capsys.readouterr().err
    assert src.read_bytes() == before


def test_a_pool_is_not_written_to_a_parquet_name(tmp_path, capsys):
    src = _write(tmp_path, _table())
    assert _replay("pool", "--table", str(src), "--out", str(tmp_path / "pool.parquet"), tmp_path=tmp_path) == 2
    assert "a pool file is YAML" in capsys.readouterr().err and not (tmp_path / "pool.parquet").exists()


def test_a_bad_table_does_not_replace_a_good_query_set(tmp_path, capsys):
    good, out = _write(tmp_path, _table()), tmp_path / "keep.parquet"
    assert _replay("queries", "--table", str(good), "--out", str(out), tmp_path=tmp_path) == 0
    before = out.read_bytes()
    blank = _write(tmp_path, _table(question=pl.when(pl.col("question_id") == "q3").then(pl.lit("  "))
                                    .otherwise(pl.col("question"))), "blank.parquet")
    for action, dest in (("queries", out), ("pool", tmp_path / "p.yaml")):
        capsys.readouterr()
        assert _replay(action, "--table", str(blank), "--out", str(dest), tmp_path=tmp_path) == 2
        assert f"replay table {blank}: column 'question' is empty for question id(s) q3" in capsys.readouterr().err
    assert out.read_bytes() == before and not (tmp_path / "p.yaml").exists()


# ---------------------------------------------------------------- F4: budgets hold with recorded costs


def test_a_budget_holds_when_recorded_costs_exceed_the_effective_price(tmp_path, monkeypatch):
    """Train rows cost $0.0008 (long answers: a low effective price), test rows $0.02 each (say,
    hidden reasoning tokens): each call must reserve the largest recorded cost, not tokens x price."""
    from conductor.replay.process import start_replay
    from conductor.runner import RunConfig, run_all

    pad = " Let me think step by step." * 60
    t = _table(response=pl.format("The answer is {}.{}", pl.col("reference"), pl.lit(pad)), correct=pl.lit(True))
    t = t.filter(pl.col("model") == "m-good").with_columns(
        pl.when(pl.col("question_id").map_elements(split_of, return_dtype=pl.String) == "test")
        .then(0.02).otherwise(0.0008).alias("cost_usd"))
    table = _write(tmp_path, t)
    pool, queries = _pool_and_queries(tmp_path, table)
    assert yaml.safe_load(pool.read_text())["workers"][0]["max_call_usd"] == 0.02
    with start_replay(pool) as server:
        monkeypatch.setenv("CONDUCTOR_REPLAY_URL", server.url)
        summary = run_all(RunConfig(queries=queries, pool=pool, data_dir=tmp_path / "data", run_id="budget",
                                    budget_usd=0.1, progress=False))
    spent = sum(r["cost_usd"] or 0.0 for r in pq.read_table(
        tmp_path / "data" / "runs" / "budget" / "traces.parquet").to_pylist())
    assert spent <= 0.1 + 1e-12, f"spent ${spent:.4f} of a $0.10 budget"
    assert spent >= 0.06 and summary["statuses"].get("budget_exhausted")  # the cap was reached, not avoided


def test_one_character_answers_without_recorded_usage_cost_a_token_not_the_request_bound(tmp_path, monkeypatch):
    """A recorded "4" with no token columns was estimated at 0 tokens (characters / 4, rounded), which
    the executor takes for lying usage and charges at the request's bound: about 180x (audit40)."""
    from conductor.replay.process import start_replay
    from conductor.runner import RunConfig, run_all

    t = _table().drop("cost_usd").with_columns(pl.lit("4").alias("response"))
    table = _write(tmp_path, t)
    prices = tmp_path / "prices.csv"
    prices.write_text("model,input_usd_per_mtok,output_usd_per_mtok\n" + "".join(f"{m},1,2\n" for m in MODELS))
    pool, queries = tmp_path / "pool.yaml", tmp_path / "q.parquet"
    assert _replay("pool", "--table", str(table), "--prices", str(prices), "--out", str(pool), tmp_path=tmp_path) == 0
    assert _replay("queries", "--table", str(table), "--out", str(queries), tmp_path=tmp_path) == 0
    with start_replay(pool) as server:
        monkeypatch.setenv("CONDUCTOR_REPLAY_URL", server.url)
        run_all(RunConfig(queries=queries, pool=pool, data_dir=tmp_path / "data", run_id="short", progress=False))
    traces = [r for r in pq.read_table(tmp_path / "data" / "runs" / "short" / "traces.parquet").to_pylist()
              if r["status"] == "ok" and r["worker"] in MODELS]
    assert traces and all(r["completion_tokens"] == 1 and "0 tokens" not in (r["error"] or "") for r in traces)
    assert all(r["cost_usd"] == pytest.approx((r["prompt_tokens"] * 1 + 2) / 1e6) for r in traces)


# ---------------------------------------------------------------- F2: one question text, two ids


@pytest.mark.parametrize("twin", ["same text", "text with blanks around it"])
def test_one_text_under_two_ids_with_other_references_is_refused_with_a_recipe(tmp_path, capsys, twin):
    t = _table()
    text = t["question"][0] if twin == "same text" else f"  {t['question'][0]}\n"
    dup = t.filter(pl.col("question_id") == "q0").with_columns(
        question_id=pl.lit("DUP-q0"), question=pl.lit(text), reference=pl.lit("999"))
    table = _write(tmp_path, pl.concat([t, dup]))
    for action, dest in (("pool", "p.yaml"), ("queries", "q.parquet")):
        assert _replay(action, "--table", str(table), "--out", str(tmp_path / dest), tmp_path=tmp_path) == 2
        err = capsys.readouterr().err
        assert "question ids q0, DUP-q0 ('What is 0 plus 0?') share one question text" in err
        assert "different references or tasks" in err and not (tmp_path / dest).exists()
    # The recipe in the message keeps one id per text; that table is accepted.
    recipe = err.split("e.g. ", 1)[1].strip()
    assert recipe.startswith("python -c ")
    subprocess.run([sys.executable, *shlex.split(recipe)[1:]], cwd=tmp_path, check=True)
    kept = tmp_path / "mine-one-id-per-text.parquet"
    assert pl.read_parquet(kept)["question_id"].n_unique() == N
    assert _replay("pool", "--table", str(kept), "--out", str(tmp_path / "p.yaml"), tmp_path=tmp_path) == 0


def test_one_text_under_two_ids_with_one_reference_is_said(tmp_path, capsys):
    """As the shared MMLU-Pro table does 7 times: the same answer key, so any recorded answer to
    the text is graded rightly; what differs (which id's answers are served) is said."""
    t = _table()
    table = _write(tmp_path, pl.concat([t, t.filter(pl.col("question_id") == "q0").with_columns(
        question_id=pl.lit("DUP-q0"))]))
    pool, queries = _pool_and_queries(tmp_path, table)
    assert "note: 1 question text(s) recorded under more than one id (q0, DUP-q0)" in capsys.readouterr().out
    assert cli_main(["eval", "--no-planner", "--pool", str(pool), "--queries", str(queries),
                     "--out", str(tmp_path / "ev")]) == 0
    assert "1 question text(s) are recorded under more than one id (q0, DUP-q0)" in \
        (tmp_path / "ev" / "report.md").read_text()


# ---------------------------------------------------------------- F10: rollouts that could never train


def test_rollouts_without_references_are_refused_before_any_plan(tmp_path, capsys):
    table = _write(tmp_path, _table(reference=pl.lit(None, pl.String)))
    pool, queries = _pool_and_queries(tmp_path, table)
    capsys.readouterr()
    data = tmp_path / "data"
    assert cli_main(["policy", "rollouts", str(queries), "--pool", str(pool), "-k", "2", "--data-dir", str(data),
                     "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no query has a reference" in err and "`conductor policy train` would find no training examples" in err
    assert not (data / "runs").exists()


# ---------------------------------------------------------------- F6, F7: the same checks everywhere, named


@pytest.mark.parametrize("change, words", [
    ({"reference": pl.lit(1.5)}, "column 'reference' must hold strings (or integers), not Float64"),
    ({"correct": pl.lit("yes")}, "column 'correct' must hold booleans or 0/1 numbers, not String"),
    ({"model": pl.when(pl.col("question_id") == "q1").then(None).otherwise(pl.col("model"))},
     "column 'model' is empty for question id(s) q1"),
])
def test_queries_and_pool_check_the_same_columns(tmp_path, capsys, change, words):
    table = _write(tmp_path, _table(**change))
    for action, dest in (("pool", "p.yaml"), ("queries", "q.parquet")):
        assert _replay(action, "--table", str(table), "--out", str(tmp_path / dest), tmp_path=tmp_path) == 2
        assert words in capsys.readouterr().err, action


def test_queries_refuse_a_repeated_question_and_model_pair(tmp_path, capsys):
    t = _table()
    table = _write(tmp_path, pl.concat([t, t.head(1)]))
    assert _replay("queries", "--table", str(table), "--out", str(tmp_path / "q.parquet"), tmp_path=tmp_path) == 2
    assert "2 rows repeat a (question_id, model) pair, e.g. question id(s) q0" in capsys.readouterr().err


def test_a_csv_table_gets_a_recipe_that_keeps_its_text_as_written(tmp_path, capsys):
    """The recipe let polars infer types: id 007 became 7, a reference 0.5 a float the table then
    refused; and it wrote into the current folder, not beside the CSV."""
    csv = tmp_path / "mine.csv"
    t = _table()
    first = t.get_column("question_id")[0]
    t.with_columns(pl.when(pl.col("question_id") == first).then(pl.lit("007")).otherwise(pl.col("question_id"))
                   .alias("question_id"), pl.lit("0.5").alias("reference")).write_csv(csv)
    assert _replay("pool", "--table", str(csv), "--out", str(tmp_path / "p.yaml"), tmp_path=tmp_path) == 2
    err = capsys.readouterr().err
    assert "replay tables are read as Parquet only: convert it first" in err
    recipe = err.split("e.g. ", 1)[1].strip()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, *shlex.split(recipe)[1:]], cwd=elsewhere, check=True)
    assert _replay("queries", "--table", str(tmp_path / "mine.parquet"), "--out", str(tmp_path / "q.parquet"),
                   tmp_path=tmp_path) == 0
    q = pl.read_parquet(tmp_path / "q.parquet")
    assert "007" in q.get_column("query_id").to_list() and set(q.get_column("reference")) == {"0.5"}


def _prices(tmp_path, text: str, encoding: str = "utf-8"):
    path = tmp_path / "prices.csv"
    path.write_text(text, encoding=encoding)
    return path


def test_price_tables_from_spreadsheets_are_read_and_their_mistakes_named_by_line(tmp_path, capsys):
    table = _write(tmp_path, _table().drop("cost_usd"))
    out = tmp_path / "p.yaml"

    def pool(prices) -> int:
        return _replay("pool", "--table", str(table), "--prices", str(prices), "--out", str(out), tmp_path=tmp_path)

    # "CSV UTF-8" from a spreadsheet: a byte order mark, blanks around names, an empty last line of cells.
    ok = _prices(tmp_path, "model , input_usd_per_mtok,output_usd_per_mtok\n m-good ,1,2\nm-bad,1,2\nm-mid,3,4\n,,\n",
                 "utf-8-sig")
    assert pool(ok) == 0
    assert load_pool(out).worker("m-good").price.input == pytest.approx(1e-6)
    for text, words in [
        ("model,input_usd_per_mtok,output_usd_per_mtok\nm-good,1,2\nm-bad,1,2\nm-good,5,6\n",
         "lines 2 and 4: model 'm-good' is listed twice"),
        ("model,input_usd_per_mtok,output_usd_per_mtok\nm-good,1,2\nm-bad,-1,2\n",
         "line 3: prices must be finite and at least 0 (model 'm-bad': -1, 2)"),
        ("model,input_usd_per_mtok,output_usd_per_mtok\nm-good,nan,2\n", "line 2: prices must be finite"),
    ]:
        capsys.readouterr()
        assert pool(_prices(tmp_path, text)) == 2
        assert f"price table {tmp_path / 'prices.csv'}, {words}" in capsys.readouterr().err


# ---------------------------------------------------------------- F8, F9: wide tables


def _wide(tmp_path, **change):
    w = pl.DataFrame({"sample_id": ["s0", "s1", "s2"], "prompt": ["1+1?", "2+2?", "3+3?"], "eval_name": ["gsm"] * 3,
                      "A": [1.0, 0.0, 1.0], "A|model_response": ["2", "5", "6"], "A|total_cost": [1e-5] * 3,
                      "B": [1.0, 1.0, None], "B|model_response": ["2", "4", "6"], "B|total_cost": [2e-5] * 3,
                      "C": [1.0, 1.0, 1.0], "C|total_cost": [3e-5] * 3})
    for col, values in change.items():
        w = w.with_columns(pl.Series(col, values))
    return _write(tmp_path, w, "wide.parquet")


@pytest.mark.parametrize("col, flag", [("sample_id", "--id-column"), ("prompt", "--prompt-column")])
def test_convert_names_the_wide_rows_without_an_id_or_prompt(tmp_path, capsys, col, flag):
    wide = _wide(tmp_path, **{col: ["x0", None, " "]})
    assert cli_main(["replay", "convert", "--wide", str(wide), "--out", str(tmp_path / "long.parquet"),
                     "--task", "math"]) == 2
    assert f"column {col!r} ({flag}) is empty at row(s) 2, 3" in capsys.readouterr().err


def test_convert_says_what_it_left_out_and_refuses_a_threshold_outside_the_scores(tmp_path, capsys):
    wide, long = _wide(tmp_path), tmp_path / "long.parquet"
    assert cli_main(["replay", "convert", "--wide", str(wide), "--out", str(long), "--task", "math"]) == 0
    out = capsys.readouterr().out
    assert "not converted, a cost column but no response column M|model_response: C" in out
    assert "1 row(s) with a response but no score: correct is empty (no label) there" in out
    for bad in ("5", "-1", "0"):
        assert cli_main(["replay", "convert", "--wide", str(wide), "--out", str(long), "--task", "math",
                         "--threshold", bad]) == 2
        assert "--threshold must be above 0 and at most 1" in capsys.readouterr().err


# ---------------------------------------------------------------- audit54 F4, F5, F7, F8


@pytest.mark.parametrize("col, value, words", [
    ("prompt_tokens", pl.lit(2 ** 64 - 1, pl.UInt64), "whole numbers of tokens from 0 to 1,000,000,000"),
    ("prompt_tokens", pl.lit(1e30), "whole numbers of tokens from 0 to 1,000,000,000"),
    ("completion_tokens", pl.lit(10 ** 18), "whole numbers of tokens from 0 to 1,000,000,000"),
    ("cost_usd", pl.lit(1e300), "USD amounts of one call: finite numbers from 0 to 10,000"),
])
def test_recorded_usage_past_any_call_is_refused_by_name(tmp_path, capsys, col, value, words):
    """2**64 - 1 (an "unknown" sentinel) and 1e30 were a polars traceback; 10**18 tokens summed past
    Int64 and the report showed a wrapped-around figure; $1e300 was printed as 300 digits."""
    table = _write(tmp_path, _table(**{col: value}))
    assert _replay("queries", "--table", str(table), "--out", str(tmp_path / "q.parquet"), tmp_path=tmp_path) == 2
    err = capsys.readouterr().err
    assert f"column '{col}' must hold {words}; other values for question id(s) q0" in err, err
    assert "Traceback" not in err


def test_graders_check_names_the_flag_of_a_missing_label_column(tmp_path, capsys):
    table = _write(tmp_path, _table())
    assert cli_main(["graders", "check", "--table", str(table), "--label-col", "nope"]) == 2
    assert "missing column(s) 'nope' (--label-col)" in capsys.readouterr().err  # it said --correct-col


def test_convert_refuses_an_infinite_cost_and_an_empty_table(tmp_path, capsys):
    """Both were written, and the next command refused what convert had said was fine."""
    long = tmp_path / "long.parquet"
    wide = _wide(tmp_path, **{"A|total_cost": [1e-5, float("inf"), 1e-5]})
    assert cli_main(["replay", "convert", "--wide", str(wide), "--out", str(long), "--task", "math"]) == 2
    assert "column 'A|total_cost' must hold USD of one call, from 0 to 10,000; found inf" in capsys.readouterr().err
    empty = _write(tmp_path, pl.read_parquet(_wide(tmp_path)).head(0), "empty.parquet")
    assert cli_main(["replay", "convert", "--wide", str(empty), "--out", str(long), "--task", "math"]) == 2
    assert f"--wide {empty}: has no rows" in capsys.readouterr().err
    assert not long.exists()


def test_a_default_dataset_name_keeps_accented_letters(tmp_path, capsys):
    table = _write(tmp_path, _table(), "my logs ünï.parquet")
    assert _replay("queries", "--table", str(table), "--out", str(tmp_path / "q.parquet"), tmp_path=tmp_path) == 0
    meta = json.loads(pq.read_table(tmp_path / "q.parquet").column("metadata")[0].as_py())
    assert meta["dataset"] == "my-logs-uni"  # was my-logs-n
