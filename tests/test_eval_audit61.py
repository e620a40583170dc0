"""audit61, `conductor eval`: a question that no worker of the pool recorded counts as wrong for
every table policy (singles, best single, oracle, random), as the pipeline's runs count it, so a
worker scores the same in any pool and the planner and the best single are compared on one basis;
an --out that is a file or cannot be created is an error naming it; no cost, however extreme,
keeps the report from being written."""

from __future__ import annotations

import json
import math
import socket
import tempfile
from pathlib import Path

import polars as pl
import pytest
import yaml

from conductor.cli import main as cli_main
from conductor.evaluation.policies import Policy

N = 40
SOLO, OTHER = "solo-model", "other-model"
UNRECORDED = range(30, 40)  # questions SOLO never answered (OTHER answered every one)
UNLABELLED = 5  # SOLO's row for this question has no `correct` label
PNG = b"\x89PNG\r\n\x1a\n"


def _table() -> pl.DataFrame:
    """A math table: SOLO answers questions 0-29 (wrong on 1, 11, 21), OTHER all 40 (wrong on every 4th)."""
    rows = []
    for i in range(N):
        question = f"Question {i}: a crate holds {i} pears and {i + 5} plums. How many fruits in the crate?"
        ref = str(2 * i + 5)
        for model, ok in ((SOLO, i % 10 != 1), (OTHER, i % 4 != 2)):
            if model == SOLO and i in UNRECORDED:
                continue
            answer = ref if ok else str(2 * i + 6)
            rows.append({"question_id": f"q{i:03d}", "question": question, "reference": ref, "model": model,
                         "response": f"{i} + {i + 5} fruits, so the answer is {answer}.",
                         "correct": None if (model == SOLO and i == UNLABELLED) else ok})
    return pl.DataFrame(rows, schema_overrides={"correct": pl.Boolean})


SOLO_RIGHT = sum(1 for i in range(N) if i not in UNRECORDED and i % 10 != 1)  # 27 (of the 40 asked)


@pytest.fixture
def files(tmp_path):
    table = tmp_path / "fruit.parquet"
    _table().write_parquet(table)
    (tmp_path / "replay-dir").mkdir()
    prices = tmp_path / "prices.csv"
    prices.write_text(f"model,input_usd_per_mtok,output_usd_per_mtok\n{SOLO},0.15,0.60\n{OTHER},0.18,0.18\n")
    flags = ["--table", str(table), "--task", "math", "--replay-dir", str(tmp_path / "replay-dir")]
    queries = tmp_path / "q.parquet"
    assert cli_main(["replay", "queries", *flags, "--out", str(queries)]) == 0
    pools = {}
    for name, models in (("solo", [SOLO]), ("both", [SOLO, OTHER])):
        pools[name] = tmp_path / f"{name}.yaml"
        assert cli_main(["replay", "pool", *flags, "--prices", str(prices), "--models", *models,
                         "--out", str(pools[name])]) == 0
    return {"dir": tmp_path, "queries": queries, **pools}


def _eval(files, pool: str, out: str, *extra: str) -> tuple[dict, str]:
    """`conductor eval` into `out`: its policies.json (policies by name) and report.md."""
    d = files["dir"] / out
    assert cli_main(["eval", "--pool", str(files[pool]), "--queries", str(files["queries"]), "--out", str(d),
                     *extra]) == 0
    data = json.loads((d / "policies.json").read_text())
    return {p["name"]: p for p in data["policies"]}, (d / "report.md").read_text()


def _loopback_port() -> int:
    """A free loopback port of 9500-9549 for the replay server eval starts (0: any free one)."""
    for port in range(9500, 9550):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return 0


def test_the_best_single_of_a_pool_scores_what_the_planner_scores_with_the_same_one_worker(files, monkeypatch,
                                                                                         capsys):
    """The pool's one worker recorded 30 of the 40 questions. The planner can only run it, so it gets
    exactly its answers and is wrong on the 10 others; the report showed the best single (the same
    worker) at 27/30 = 0.900 beside the planner's 27/40 = 0.675, and said only 30 queries 'have a
    reference' (all 40 have one)."""
    from conductor.replay import process

    start = process.start_replay
    monkeypatch.setattr(process, "start_replay", lambda pool, port=0, **kw: start(pool, _loopback_port(), **kw))
    policies, report = _eval(files, "solo", "ev")
    printed = capsys.readouterr().out
    planner = next(p for p in policies.values() if p["kind"] == "planner")
    assert planner["accuracy"] == pytest.approx(SOLO_RIGHT / N)
    for name in (f"best single (our grader): {SOLO}", f"best single (labels): {SOLO}", SOLO,
                 "oracle (our grader)", "uniform random (expected)"):
        assert policies[name]["accuracy"] == pytest.approx(planner["accuracy"]), name
    best = policies[f"best single (our grader): {SOLO}"]
    assert best["usd_per_query"] == pytest.approx(planner["usd_per_query"], rel=1e-6)
    assert best["tokens_per_query"] == pytest.approx(planner["tokens_per_query"], rel=1e-6)
    # By the labels: 26 right of the 39 labelled questions (the unrecorded 10 count, as wrong).
    assert best["accuracy_labels"] == pytest.approx((SOLO_RIGHT - 1) / (N - 1))
    assert policies["oracle (labels)"]["accuracy_labels"] == pytest.approx((SOLO_RIGHT - 1) / (N - 1))
    assert "that have a reference" not in report  # every query has one
    assert "the 39 of the 40 queries whose rows all have one" in report
    assert "their 1 queries are left out" in report
    assert "10 of the 40 queries were recorded by no worker of the pool" in report
    assert "10 queries recorded by no worker of the pool, wrong for every policy" in printed


def test_a_worker_scores_the_same_in_a_pool_of_some_of_the_tables_models(files):
    """`replay pool --models`: SOLO alone used to score 0.900 (27 of the 30 it recorded) where, beside
    OTHER, it scored 0.675 on the same 40 queries; USD and tokens per query were over all 40 either way."""
    alone, _ = _eval(files, "solo", "ev-solo", "--no-planner")
    beside, _ = _eval(files, "both", "ev-both", "--no-planner")
    for key in ("accuracy", "accuracy_labels", "usd_per_query", "tokens_per_query", "coverage", "se"):
        assert alone[SOLO][key] == pytest.approx(beside[SOLO][key]), key
    assert alone[SOLO]["accuracy"] == pytest.approx(SOLO_RIGHT / N)
    assert alone[SOLO]["accuracy_labels"] == pytest.approx((SOLO_RIGHT - 1) / (N - 1))
    # Uniform random makes no call on an unrecorded question, and gets it wrong.
    rnd = alone["uniform random (expected)"]
    assert rnd["calls_per_query"] == pytest.approx(30 / N) and rnd["accuracy"] == pytest.approx(SOLO_RIGHT / N)
    oracle = alone["oracle (our grader)"]
    assert oracle["accuracy"] == pytest.approx(SOLO_RIGHT / N) and oracle["calls_per_query"] == pytest.approx(
        SOLO_RIGHT / N)


def test_an_out_that_is_a_file_or_cannot_be_made_is_named(files, capsys):
    """`--out report.md` raised FileExistsError with a traceback; a folder under /proc, FileNotFoundError."""
    existing = files["dir"] / "report.md"
    existing.write_text("my notes\n")
    base = ["eval", "--pool", str(files["solo"]), "--queries", str(files["queries"]), "--no-planner", "--out"]
    capsys.readouterr()
    assert cli_main([*base, str(existing)]) == 2
    assert f"--out {existing}: is a file, not a folder" in capsys.readouterr().err
    assert existing.read_text() == "my notes\n"
    assert cli_main([*base, str(existing / "sub")]) == 2
    assert f"--out {existing / 'sub'}: cannot create the report folder" in capsys.readouterr().err
    if Path("/proc/self").is_dir():
        assert cli_main([*base, "/proc/conductor-eval"]) == 2
        assert "--out /proc/conductor-eval: cannot create the report folder" in capsys.readouterr().err


def _priced(files, price: float) -> Path:
    """The two-worker pool with OTHER priced at `price` USD per million tokens (a finite number)."""
    raw = yaml.safe_load(files["both"].read_text())
    for w in raw["workers"]:
        if w["id"] == OTHER:
            w["price"] = {"input_per_mtok": price, "output_per_mtok": price}
    path = files["dir"] / "dear.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize("price", [1e300, 1.7e308])
def test_a_huge_finite_price_does_not_stop_the_report(files, price, capsys):
    """A price of 1e300 per million tokens: the chart's log axis overflowed (OverflowError) and no
    report.md was written. The costs it cannot place are left off it, and the report names them."""
    out = files["dir"] / "ev-dear"
    assert cli_main(["eval", "--pool", str(_priced(files, price)), "--queries", str(files["queries"]),
                     "--no-planner", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert (out / "chart.png").read_bytes().startswith(PNG)
    off = next(line for line in report.splitlines() if line.startswith("Not on the chart"))
    assert f"{OTHER} ($" in off and "uniform random (expected)" in off and SOLO + " (" not in off
    assert f"| {OTHER} |" in report  # the figures are all in the tables


def test_the_chart_draws_whatever_the_costs():
    """Costs of $0 (no place on a log axis), 1e305 and infinity, and NaN: drawn without them."""
    from conductor.evaluation.report import chart

    costs = {"free": 0.0, "cheap": 1e-3, "dear": 2e-3, "absurd": 1e305, "endless": math.inf, "nan": math.nan}
    ps = [Policy("single", name, 0.5 + i / 20, None, usd, 1.0, 100.0, 10, worker=name)
          for i, (name, usd) in enumerate(costs.items())]
    with tempfile.TemporaryDirectory() as d:
        path = chart(ps, Path(d) / "chart.png", "extreme costs")
        assert path.read_bytes().startswith(PNG)
    from conductor.evaluation.report import markdown, off_chart

    left = off_chart(ps)
    assert [o["name"] for o in left] == ["free", "absurd", "endless", "nan"]
    meta = {"queries": 10, "dataset": "x", "split": "all", "pool": "p", "workers": 6, "queries_path": "q",
            "table": "t", "rows": 60, "graded_queries": 10, "labelled_queries": 0, "unlabelled_rows": 60,
            "selection": "s", "grading_s": 0.0, "wall_time_s": 0.0, "off_chart": left}
    text = markdown(meta, ps, "chart.png")
    assert "Not on the chart" in text and "absurd ($1e+305)" in text and "endless ($inf)" in text


def test_a_chart_that_cannot_be_drawn_leaves_the_report_written(files, monkeypatch, capsys):
    import conductor.evaluation as evaluation

    out = files["dir"] / "ev-nochart"
    args = ["eval", "--pool", str(files["both"]), "--queries", str(files["queries"]), "--no-planner",
            "--out", str(out)]
    assert cli_main(args) == 0
    drawn = (out / "chart.png").read_bytes()

    def broken(*a, **kw):
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setattr(evaluation, "chart", broken)
    capsys.readouterr()
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    report = (out / "report.md").read_text()
    assert "The chart could not be drawn (OverflowError: cannot convert float infinity to integer)" in report
    assert "](chart.png)" not in report and f"| {SOLO} |" in report
    assert "the chart could not be drawn" in captured.err and "chart  not drawn (OverflowError" in captured.out
    # No chart of the earlier evaluation is left to pass for this one's.
    assert (out / "chart.png").read_bytes() != drawn
