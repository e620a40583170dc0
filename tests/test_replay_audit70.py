"""audit70: the "Replay data and evaluation" section. `graders check --out` never overwrites its
own table and writes whole files; `replay convert` keeps a CSV's ids, references and responses as
written; `graders check` reads rows with no reference, a blank task and a `.CSV` file as the replay
commands and eval do; eval's headline, a single worker's calls and an all-$0 chart say what is so."""

from __future__ import annotations

import csv
import json

import polars as pl
import pytest

from conductor.cli import main as cli_main

N = 40
SOLO, OTHER = "solo-model", "other-model"


def _table(n: int = N, solo_missing: int = 0) -> pl.DataFrame:
    """A math table of two models: SOLO right but on every 10th question, OTHER but on every 5th;
    SOLO recorded no answer to the last `solo_missing` questions."""
    rows = []
    for i in range(n):
        ref = str(2 * i + 3)
        question = f"Question {i}: a shop sells {i} apples and then {i + 3} more. How many apples in all?"
        for model, every in ((SOLO, 10), (OTHER, 5)):
            if model == SOLO and i >= n - solo_missing:
                continue
            ok = i % every != 1
            rows.append({"question_id": f"q{i:03d}", "question": question, "reference": ref, "model": model,
                         "response": f"So the answer is {ref if ok else 2 * i + 4}.", "correct": ok})
    return pl.DataFrame(rows)


def _check(*args: str) -> int:
    return cli_main(["graders", "check", "--examples", "0", *map(str, args)])


# ---------------------------------------------------------------- F1: graders check --out


def test_graders_out_is_never_the_table_a_folder_or_unwritable(tmp_path, capsys):
    """`--out victim.csv` with `--table victim.csv` replaced the user's table with the disagreements;
    a folder or a path under /proc was a traceback."""
    table = tmp_path / "victim.csv"
    _table().write_csv(table)
    before = table.read_bytes()
    assert _check("--table", table, "--task", "math", "--out", tmp_path / "." / "victim.csv") == 2
    err = capsys.readouterr().err
    assert "--out" in err and f"same file as --table {table}" in err, err
    assert table.read_bytes() == before
    folder = tmp_path / "adir"
    folder.mkdir()
    assert _check("--table", table, "--task", "math", "--out", folder) == 2
    assert f"--out {folder}: is a folder" in capsys.readouterr().err
    assert _check("--table", table, "--task", "math", "--out", "/proc/x.csv") == 2
    assert "--out /proc/x.csv: cannot write it" in capsys.readouterr().err
    assert _check("--table", table, "--task", "math", "--out", table / "x.csv") == 2  # a file as a folder
    assert f"--out {table / 'x.csv'}" in capsys.readouterr().err
    assert table.read_bytes() == before


def test_graders_out_that_fails_mid_write_leaves_the_earlier_file_whole(tmp_path, capsys, monkeypatch):
    """The CSV was written in place: a full disk halfway left half a file where the last one was."""
    table = tmp_path / "t.parquet"
    _table().with_columns(correct=pl.lit(True)).write_parquet(table)  # the 12 wrong answers disagree
    out = tmp_path / "dis.csv"
    assert _check("--table", table, "--task", "math", "--out", out) == 0
    earlier = out.read_bytes()
    assert len(list(csv.DictReader(earlier.decode().splitlines()))) == 12  # 4 wrong of SOLO, 8 of OTHER
    real = csv.writer

    class Full:
        def __init__(self, f):
            self.w, self.rows = real(f), 0

        def writerow(self, row):
            self.rows += 1
            if self.rows > 3:
                raise OSError(28, "No space left on device")
            self.w.writerow(row)

    monkeypatch.setattr(csv, "writer", Full)
    assert _check("--table", table, "--task", "math", "--out", out) == 2
    assert f"--out {out}: cannot write it (No space left on device)" in capsys.readouterr().err
    assert out.read_bytes() == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dis.csv", "t.parquet"]  # no temporary file left


# ---------------------------------------------------------------- F2: replay convert of a CSV


def test_convert_keeps_a_csv_tables_text_as_written(tmp_path, capsys):
    """Types were guessed: id 007 became 7 (and then repeated id 7), response 007 "7.0", gold 1.50 "1.5"."""
    wide = tmp_path / "wide.csv"
    wide.write_text("sample_id,prompt,gold,m1,m1|model_response,m1|total_cost\n"
                    "007,Spell the code,007,1,007,0.001\n"
                    "0012,What is 1.50 as text?,1.50,0,1.5,0.002\n"
                    "7,Seven?,7,true, 7 ,\n")
    long = tmp_path / "long.parquet"
    assert cli_main(["replay", "convert", "--wide", str(wide), "--out", str(long), "--reference-column", "gold",
                     "--category-column", "", "--task", "literal"]) == 0
    rows = pl.read_parquet(long).select("question_id", "reference", "response", "correct", "cost_usd").rows()
    assert rows == [("007", "007", "007", True, 0.001), ("0012", "1.50", "1.5", False, 0.002),
                    ("7", "7", " 7 ", True, None)]
    # A score or a cost that is not a number is named, with its column.
    for column, value, what in (("m1", "yes", "a score"), ("m1|total_cost", "$0.01", "USD")):
        bad = tmp_path / "bad.csv"
        bad.write_text("sample_id,prompt,m1,m1|model_response,m1|total_cost\n1,a,1,x,0.01\n"
                       + ("2,b,yes,y,0.1\n" if column == "m1" else "2,b,0,y,$0.01\n"))
        assert cli_main(["replay", "convert", "--wide", str(bad), "--out", str(long), "--category-column", "",
                         "--task", "literal"]) == 2
        err = capsys.readouterr().err
        assert f"column {column!r} must hold numbers ({what}" in err and repr(value) in err, err


# ---------------------------------------------------------------- F3, F4, F5: graders check reads as eval does


def test_graders_check_leaves_out_rows_with_no_reference_and_counts_them(tmp_path, capsys):
    """They were graded against "" and counted as disagreements (0.00% on a converted RouterBench table)."""
    t = _table(10).with_columns(
        reference=pl.when(pl.col("question_id") == "q002").then(pl.lit(None, pl.String))
        .when(pl.col("question_id") == "q004").then(pl.lit("  ")).otherwise(pl.col("reference")))
    table = tmp_path / "t.parquet"
    t.write_parquet(table)
    assert _check("--table", table, "--task", "math") == 0
    out = capsys.readouterr().out
    assert "16 rows (4 row(s) with no reference: not graded), agreement 100.00%, 0 disagreement(s)" in out, out
    t.with_columns(reference=pl.lit("", pl.String)).write_parquet(table)
    assert _check("--table", table, "--task", "math") == 2
    assert "no labelled row has a reference in column 'reference'" in capsys.readouterr().err


def test_graders_check_takes_a_blank_task_as_none(tmp_path, capsys):
    """A blank task was "unknown task(s) ''", where every replay command fills it from --task."""
    path = tmp_path / "blank.parquet"
    _table(10).with_columns(task=pl.when(pl.col("question_id") < "q005").then(pl.lit("math"))
                            .otherwise(pl.lit(" "))).write_parquet(path)
    assert _check("--table", path, "--task", "math") == 0
    assert "(math 20): 20 rows, agreement 100.00%" in capsys.readouterr().out


def test_graders_check_reads_a_csv_named_in_capitals(tmp_path, capsys):
    """BASE.CSV (as Windows names files) was read as Parquet: 'Parquet magic bytes not found'."""
    path = tmp_path / "BASE.CSV"
    _table(10).write_csv(path)
    assert _check("--table", path, "--task", "math") == 0
    assert "BASE (math 20): 20 rows, agreement 100.00%" in capsys.readouterr().out


# ---------------------------------------------------------------- F6, F7, F8: eval's report


def _eval_files(tmp_path, table: pl.DataFrame, *models: str, prices: str = "0.15,0.60") -> dict:
    path = tmp_path / "mine.parquet"
    table.write_parquet(path)
    (tmp_path / "replay-dir").mkdir(exist_ok=True)
    price_csv = tmp_path / "prices.csv"
    price_csv.write_text("model,input_usd_per_mtok,output_usd_per_mtok\n"
                         + "".join(f"{m},{prices}\n" for m in (SOLO, OTHER)))
    flags = ["--table", str(path), "--task", "math", "--replay-dir", str(tmp_path / "replay-dir")]
    files = {"queries": tmp_path / "q.parquet", "pool": tmp_path / "pool.yaml"}
    assert cli_main(["replay", "queries", *flags, "--out", str(files["queries"])]) == 0
    assert cli_main(["replay", "pool", *flags, "--prices", str(price_csv), "--out", str(files["pool"]),
                     *(["--models", *models] if models else [])]) == 0
    return files


def _eval(tmp_path, files: dict, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "ev"
    assert cli_main(["eval", "--pool", str(files["pool"]), "--queries", str(files["queries"]), "--out", str(out),
                     *extra]) == 0
    data = json.loads((out / "policies.json").read_text())
    return {p["name"]: p for p in data["policies"]}, (out / "report.md").read_text()


def test_eval_headline_does_not_say_no_row_is_labelled_when_most_are(tmp_path, capsys):
    """SOLO has no label on any row, OTHER on all 40: 'no labelled row to compare our grader with'."""
    t = _table().with_columns(correct=pl.when(pl.col("model") == OTHER).then(pl.col("correct")))
    files = _eval_files(tmp_path, t)
    capsys.readouterr()
    _eval(tmp_path, files, "--no-planner")
    printed = capsys.readouterr().out
    assert ("no query has a label on every row (40 row(s) labelled), so nothing is compared with the labels; "
            "40 row(s) with no label: 40 queries left out of accuracy (labels)") in printed, printed
    assert "no labelled row" not in printed


def test_a_single_worker_makes_no_call_on_a_question_it_never_answered(tmp_path, capsys):
    """The pipeline plans no step for a worker with no recorded answer (the planner made 0.75 calls a
    query with the one worker that recorded 30 of 40 questions) while the table counted its single
    worker at 1.00, saying it counted them 'as the pipeline's runs count them'."""
    files = _eval_files(tmp_path, _table(solo_missing=10), SOLO)
    policies, report = _eval(tmp_path, files)
    planner = next(p for p in policies.values() if p["kind"] == "planner")
    assert planner["calls_per_query"] == pytest.approx(30 / N)
    for name in (SOLO, f"best single (our grader): {SOLO}", f"best single (labels): {SOLO}"):
        assert policies[name]["calls_per_query"] == pytest.approx(planner["calls_per_query"]), name
    assert f"| best single (labels): {SOLO} | 0.675 | 0.074 | 0.675 |" in report
    assert "still counts its refused call" not in report
    assert "spends nothing and makes no call on them, as the pipeline's runs count them" in report


def test_an_all_free_table_draws_its_chart_without_a_legend_warning(tmp_path, capsys, recwarn):
    """Every row at $0: matplotlib's 'No artists with labels found to put in legend' on stderr."""
    files = _eval_files(tmp_path, _table().with_columns(cost_usd=pl.lit(0.0)))
    _, report = _eval(tmp_path, files, "--no-planner")
    assert "Not on the chart" in report and "uniform random (expected) ($0)" in report
    assert not [w for w in recwarn.list if "legend" in str(w.message)], [str(w.message) for w in recwarn.list]
    assert "legend" not in capsys.readouterr().err


def test_a_missing_replay_folder_is_said_before_outs_folder_is_made(tmp_path, capsys):
    """review41 7: graders check made --out's folder, then refused the missing replay folder."""
    out = tmp_path / "new" / "disagreements.csv"
    assert cli_main(["graders", "check", "--replay", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert f"replay folder {tmp_path / 'nowhere'} not found" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
