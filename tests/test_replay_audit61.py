"""audit61: recorded tables a user brings. Usage recorded as 0 tokens is no usage (single workers
and plans priced alike); one costed row does not replace a listed model's price; text that is not
UTF-8, a price table that is not UTF-8, an absurd price or an --out that cannot be written are
errors naming what is wrong; a table named like a shared dataset does not inherit its provenance,
and tables whose names have no ASCII letters are told apart."""

from __future__ import annotations

import json

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.cli import main as cli_main
from conductor.pool import load_pool
from conductor.tokens import tokens_from_chars
from tests.conftest import REPLAY

N = 40
CHEAP, OTHER = "cheap-model", "other-model"
PRICES = {CHEAP: (0.15, 0.60), OTHER: (0.18, 0.18)}


def _table(n: int = N) -> pl.DataFrame:
    """A small math table of two models; CHEAP is wrong on every 10th question, OTHER on every 5th."""
    rows = []
    for i in range(n):
        question = f"Question {i}: a shop sells {i} apples and then {i + 3} more. How many apples in all?"
        ref = str(2 * i + 3)
        for model, every in ((CHEAP, 10), (OTHER, 5)):
            ok = i % every != 1
            answer = ref if ok else str(2 * i + 4)
            rows.append({"question_id": f"q{i:03d}", "question": question, "reference": ref, "model": model,
                         "response": f"{i} + {i + 3} apples, so the answer is {answer}." + " Checked." * (i % 7),
                         "correct": ok})
    return pl.DataFrame(rows)


def _prices(path, rows=None) -> None:
    rows = rows or [f"{m},{p_in},{p_out},list price" for m, (p_in, p_out) in PRICES.items()]
    path.write_text("model,input_usd_per_mtok,output_usd_per_mtok,basis\n" + "\n".join(rows) + "\n")


def _flags(tmp_path, cmd: str = "pool") -> list[str]:
    """No shared folder (an empty one) and, for `replay pool`, the test's own price table."""
    (tmp_path / "replay-dir").mkdir(exist_ok=True)
    if not (tmp_path / "prices.csv").exists():
        _prices(tmp_path / "prices.csv")
    return ["--task", "math", "--replay-dir", str(tmp_path / "replay-dir"),
            *(["--prices", str(tmp_path / "prices.csv")] if cmd == "pool" else [])]


def _write_with_bytes(table: pl.DataFrame, column: str, row: int, raw: bytes, path) -> None:
    """`table` as Parquet with `column` a String column whose row `row` holds `raw` (not UTF-8),
    as some writers produce."""
    values = [v.encode() for v in table.get_column(column).to_list()]
    values[row] = raw
    b = pa.array(values, pa.binary())
    at = table.to_arrow()
    at = at.set_column(at.column_names.index(column), column,
                       pa.Array.from_buffers(pa.string(), len(b), b.buffers()))
    pq.write_table(at, path)


# ---------------------------------------------------------------- F2: 0 tokens recorded beside text


def test_usage_recorded_as_zero_is_priced_as_a_plan_of_the_same_worker_pays(tmp_path, capsys, monkeypatch):
    """A log that wrote 0 where usage was not captured: the table policies were free ($0, 0 tokens)
    while the planner, running the same worker's same answers, paid the executor's bound."""
    import conductor.replay.process as process

    start = process.start_replay  # eval's own replay server, on a port of the range this suite may use
    monkeypatch.setattr(process, "start_replay", lambda pool, port=0, host="127.0.0.1", **kw:
                        start(pool, port=9553, host=host, **kw))
    path = tmp_path / "zero_tokens.parquet"
    t = _table().with_columns(prompt_tokens=pl.lit(0, pl.Int64), completion_tokens=pl.lit(0, pl.Int64))
    t.write_parquet(path)
    pool, queries, out = tmp_path / "pool.yaml", tmp_path / "q.parquet", tmp_path / "ev"
    assert cli_main(["replay", "queries", "--table", str(path), "--out", str(queries), *_flags(tmp_path, "queries")]) == 0
    assert cli_main(["replay", "pool", "--table", str(path), "--models", CHEAP, "--out", str(pool),
                     *_flags(tmp_path)]) == 0
    assert cli_main(["eval", "--pool", str(pool), "--queries", str(queries), "--out", str(out)]) == 0
    policies = json.loads((out / "policies.json").read_text())["policies"]
    planner = next(p for p in policies if p["kind"] == "planner")
    single = next(p for p in policies if p["kind"] == "single" and p["worker"] == CHEAP)
    assert planner["queries"] == N and planner["calls_per_query"] == 1.0  # one plan: the one worker
    # Characters / 4 of the question and the response, as for any row whose usage was not recorded.
    rows = t.filter(pl.col("model") == CHEAP)
    tokens = sum(tokens_from_chars(len(q)) + tokens_from_chars(len(r))
                 for q, r in rows.select("question", "response").iter_rows())
    assert single["tokens_per_query"] == pytest.approx(tokens / N)
    assert single["usd_per_query"] > 0
    assert planner["tokens_per_query"] == pytest.approx(single["tokens_per_query"])
    assert planner["usd_per_query"] == pytest.approx(single["usd_per_query"], rel=1e-9)


# ---------------------------------------------------------------- F3: one costed row of a listed model


def test_one_recorded_cost_leaves_a_listed_models_other_rows_at_its_list_price(tmp_path, capsys):
    """CHEAP is listed and one of its rows records $0.50: that row costs $0.50, the other 39 the
    list price (they cost 40 times as much, at an 'effective price' made of that one row). OTHER is
    not listed: its costed rows give it an effective price, as before."""
    path = tmp_path / "one_cost.parquet"
    first = pl.int_range(pl.len()).over("model") == 0
    even = pl.int_range(pl.len()).over("model") % 2 == 0
    t = _table().with_columns(cost_usd=pl.when(first & (pl.col("model") == CHEAP)).then(pl.lit(0.5))
                              .when(even & (pl.col("model") == OTHER)).then(pl.lit(0.001))
                              .otherwise(pl.lit(None, pl.Float64)))
    t.write_parquet(path)
    _prices(tmp_path / "prices.csv", [f"{CHEAP},0.15,0.60,list price"])
    pool, queries, out = tmp_path / "pool.yaml", tmp_path / "q.parquet", tmp_path / "ev"
    assert cli_main(["replay", "queries", "--table", str(path), "--out", str(queries), *_flags(tmp_path, "queries")]) == 0
    assert cli_main(["replay", "pool", "--table", str(path), "--out", str(pool), *_flags(tmp_path)]) == 0
    cheap, other = load_pool(pool).worker(CHEAP), load_pool(pool).worker(OTHER)
    assert (cheap.price.input, cheap.price.output) == (pytest.approx(0.15e-6), pytest.approx(0.60e-6))
    assert "its recorded cost_usd is charged on 1 of its 40 rows" in cheap.description
    assert other.price.input == other.price.output and "input and output alike: the recorded cost_usd" in other.description
    assert cli_main(["eval", "--pool", str(pool), "--queries", str(queries), "--out", str(out), "--no-planner"]) == 0
    single = next(p for p in json.loads((out / "policies.json").read_text())["policies"]
                  if p["kind"] == "single" and p["worker"] == CHEAP)
    rows = t.filter(pl.col("model") == CHEAP)
    listed = sum(tokens_from_chars(len(q)) * 0.15e-6 + tokens_from_chars(len(r)) * 0.60e-6
                 for q, r, c in rows.select("question", "response", "cost_usd").iter_rows() if c is None)
    assert single["usd_per_query"] == pytest.approx((0.5 + listed) / N, rel=1e-9)  # was 40 times that


# ---------------------------------------------------------------- F4: text that is not UTF-8


@pytest.mark.parametrize("column", ["response", "question"])
def test_text_that_is_not_utf8_is_named_by_every_replay_command(tmp_path, capsys, column):
    good, bad = tmp_path / "good.parquet", tmp_path / "bad.parquet"
    t = _table()
    t.write_parquet(good)
    _write_with_bytes(t, column, 2, t.get_column(column)[2].encode() + b" caf\xe9", bad)
    for cmd, out in (("queries", "q.parquet"), ("pool", "p.yaml")):
        assert cli_main(["replay", cmd, "--table", str(bad), "--out", str(tmp_path / out), *_flags(tmp_path, cmd)]) == 2
        err = capsys.readouterr().err
        assert f"replay table {bad}: text that is not valid UTF-8 in column '{column}'" in err, err
        assert "question id(s) q001" in err and not (tmp_path / out).exists()
    # eval and the server, on a pool whose table was replaced by the bad one
    pool, queries = tmp_path / "pool.yaml", tmp_path / "q.parquet"
    assert cli_main(["replay", "pool", "--table", str(good), "--out", str(pool), *_flags(tmp_path)]) == 0
    assert cli_main(["replay", "queries", "--table", str(good), "--out", str(queries), *_flags(tmp_path, "queries")]) == 0
    good.write_bytes(bad.read_bytes())
    doc = yaml.safe_load(pool.read_text())  # a pool written before tables were fingerprinted
    del doc["replay"]["fingerprint"]
    pool.write_text(yaml.safe_dump(doc, sort_keys=False))
    capsys.readouterr()
    assert cli_main(["eval", "--pool", str(pool), "--queries", str(queries), "--out", str(tmp_path / "ev"),
                     "--no-planner"]) == 2
    assert f"text that is not valid UTF-8 in column '{column}'" in capsys.readouterr().err
    assert cli_main(["replay", "serve", "--pool", str(pool), "--port", "9554"]) == 2
    assert f"text that is not valid UTF-8 in column '{column}'" in capsys.readouterr().err


@pytest.mark.parametrize("binary", [False, True])
def test_graders_check_reads_bytes_that_are_not_utf8_as_replacement_characters(tmp_path, capsys, binary):
    """As the README says of `graders check --table`, for Parquet as for CSV (and a Binary column)."""
    t = _table(10).filter(pl.col("model") == CHEAP)
    path = tmp_path / "bad.parquet"
    if binary:
        at = t.to_arrow()
        values = [v.encode() for v in t.get_column("response").to_list()]
        values[0] = b"The answer is 3 caf\xe9"
        pq.write_table(at.set_column(at.column_names.index("response"), "response",
                                     pa.array(values, pa.binary())), path)
    else:
        _write_with_bytes(t, "response", 0, b"The answer is 3 caf\xe9", path)
    assert cli_main(["graders", "check", "--table", str(path), "--task", "math", "--examples", "5"]) == 0
    assert "10 rows, agreement 100.00%" in capsys.readouterr().out


# ---------------------------------------------------------------- F5, F6: price tables


def test_a_price_table_that_is_not_utf8_names_its_line(tmp_path, capsys):
    path = tmp_path / "t.parquet"
    _table().write_parquet(path)
    (tmp_path / "prices.csv").write_bytes(  # Excel's plain "CSV": Windows-1252, an en dash is 0x96
        b"model,input_usd_per_mtok,output_usd_per_mtok,basis\n"
        + f"{OTHER},0.18,0.18,hosted\n{CHEAP},0.15,0.60,OpenAI list price ".encode() + b"\x96 2024\n")
    assert cli_main(["replay", "pool", "--table", str(path), "--out", str(tmp_path / "p.yaml"),
                     *_flags(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"price table {tmp_path / 'prices.csv'}, line 3: not UTF-8 text (byte 0x96)" in err, err


def test_a_price_beyond_any_real_one_is_refused_with_its_line(tmp_path, capsys):
    path = tmp_path / "t.parquet"
    _table().write_parquet(path)
    _prices(tmp_path / "prices.csv", [f"{OTHER},0.18,0.18,x", f"{CHEAP},1e300,1e300,x"])
    assert cli_main(["replay", "pool", "--table", str(path), "--out", str(tmp_path / "p.yaml"),
                     *_flags(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"price table {tmp_path / 'prices.csv'}, line 3: prices must be at most 1,000,000 USD per million tokens" in err
    _prices(tmp_path / "prices.csv", [f"{OTHER},0.18,0.18,x", f"{CHEAP},1000000,1000000,x"])  # the bound itself
    assert cli_main(["replay", "pool", "--table", str(path), "--out", str(tmp_path / "p.yaml"),
                     *_flags(tmp_path)]) == 0


# ---------------------------------------------------------------- F7: an --out that cannot be written


@pytest.mark.parametrize("cmd,out", [("pool", "/proc/conductor-audit61.yaml"),
                                     ("queries", "/proc/conductor-audit61.parquet")])
def test_an_out_that_cannot_be_written_is_named(tmp_path, capsys, cmd, out):
    path = tmp_path / "t.parquet"
    _table().write_parquet(path)
    assert cli_main(["replay", cmd, "--table", str(path), "--out", out, *_flags(tmp_path, cmd)]) == 2
    assert f"--out {out}: cannot write it" in capsys.readouterr().err


# ---------------------------------------------------------------- F8: names


def test_a_table_named_like_a_shared_dataset_does_not_get_its_provenance(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    _table().write_parquet(mine / "gsm8k.parquet")
    for table, extra in ((mine / "gsm8k.parquet", []), (mine / "gsm8k.parquet", ["--name", "mmlu_pro"])):
        pool = tmp_path / "pool.yaml"
        assert cli_main(["replay", "pool", "--table", str(table), "--out", str(pool), *extra,
                         *_flags(tmp_path)]) == 0
        text = pool.read_text()
        assert "ZeroEval" not in text and "TIGER-AI-Lab" not in text
        assert "real recorded responses from the replay table gsm8k.parquet" in load_pool(pool).worker(CHEAP).description


@pytest.mark.skipif(not (REPLAY / "gsm8k.parquet").is_file(), reason=f"shared replay data not found at {REPLAY}")
def test_the_shared_table_keeps_its_provenance_by_path_and_by_flag(tmp_path):
    for which in (["--dataset", "gsm8k"], ["--table", str(REPLAY / "gsm8k.parquet"), "--name", "mine"]):
        pool = tmp_path / "pool.yaml"
        assert cli_main(["replay", "pool", *which, "--models", "gpt-4o-mini-2024-07-18", "--out", str(pool),
                         "--replay-dir", str(REPLAY)]) == 0
        doc = yaml.safe_load(pool.read_text())
        assert "GSM8K test, zero-shot, JSON-formatted answers (ZeroEval)" in doc["workers"][0]["description"]


def test_tables_whose_names_have_no_ascii_letters_get_distinct_names(tmp_path, capsys):
    names = {}
    for stem in ("日本", "中文", "ünï"):
        path = tmp_path / f"{stem}.parquet"
        _table(4).write_parquet(path)
        out = tmp_path / f"q-{len(names)}.parquet"
        assert cli_main(["replay", "queries", "--table", str(path), "--out", str(out), *_flags(tmp_path, "queries")]) == 0
        names[stem] = json.loads(pq.read_table(out).column("metadata")[0].as_py())["dataset"]
    assert names["ünï"] == "uni"  # accents dropped, the letters kept
    assert len({names["日本"], names["中文"]}) == 2 and "table" not in (names["日本"], names["中文"])
    assert all(n.startswith("table-") and n.isascii() for n in (names["日本"], names["中文"]))
