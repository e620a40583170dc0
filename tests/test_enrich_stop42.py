"""audit75: the invalid-row summary counts one cause once whatever the parse position (F1); a
boolean id column (F2), JSON Lines files polars misreads or refuses in its own words (F3), a
typo inside a join entry (F5), job-file values that were ignored (F6) and numeric filters on CSV
text (F7) are refused by `job check` naming the file, the line and what is wrong."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from conductor.enrich import load_job
from conductor.enrich.run import record_failure_groups, run_job
from conductor.records import RecordChecker
from tests.conftest import cli, write_pool
from tests.test_enrich_job import GOOD, folder, line_of, write  # noqa: F401 - folder is a fixture


def checked(folder: Path, text: str):
    """`conductor job check` on the text, as a user runs it."""
    return cli("job", "check", write(folder, text))


def refused_at(folder: Path, text: str, needle: str) -> str:
    """The error `job check` prints, which must name the job file and the needle's line."""
    r = checked(folder, text)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert f"job.yaml:{line_of(text, needle)}: " in r.stderr, r.stderr
    return r.stderr


# ---- F1: one cause, whatever the position the parser names --------------------------------

def test_replies_cut_off_at_different_lengths_are_one_cause_in_the_summary(fresh_sim, tmp_path):
    (tmp_path / "in.csv").write_text("nid,body\n" + "".join(f"{i},revenue rose {i}% to {i}.5 million in 2023\n"
                                                            for i in range(1, 41)))
    write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "cut", "input": {"path": "in.csv", "id": "nid"}, "prompt": "Read: {{ body }}",
        "fields": {"amount": {"type": "number"}, "note": {"type": "string"}}, "pool": "pool.yaml",
        "worker": "fast"}))
    fresh_sim.set_faults("*", malformed_json=1.0)  # every reply and every repair is broken
    s = run_job(load_job(tmp_path / "job.yaml"), data_dir=tmp_path / "data", progress=False)
    errors = pq.read_table(s["records_path"]).column("error").to_pylist()
    cut = [e for e in errors if "not valid JSON" in e]
    assert len({e for e in cut}) > 1  # the records keep each position
    assert all(re.search(r"line \d+ column \d+ \(char \d+\)", e) for e in cut)
    groups = [g for g in s["failures"] if "not valid JSON" in g["error"]]
    assert len(groups) == 1 and groups[0]["rows"] == len(cut), s["failures"]
    assert re.search(r"line 1 column \d+ \(char \d+\) to line 1 column \d+ \(char \d+\)$", groups[0]["error"])
    shown = sum(g["rows"] for g in s["failures"]) + s["failures_not_shown"]["rows"]
    assert shown == s["failed"] == 40


def test_a_cause_is_counted_once_and_shown_with_the_range_of_its_positions():
    checker = RecordChecker({"type": "object", "properties": {"a": {"type": "string"}}})
    reply = '{"a": "one two three four five six seven"}'
    errors = [checker.check(reply[:n])[1] for n in (9, 14, 20, 20, 31)]
    assert len(set(errors)) == 4
    table = pa.table({"status": ["invalid"] * 5 + ["ok"], "error": errors + [None]})
    shown, rest = record_failure_groups(table)
    assert shown == [{"status": "invalid", "rows": 5, "error": "not valid JSON: unexpected end of data: "
                      "line 1 column 10 (char 9) to line 1 column 31 (char 30)"}]
    assert rest == {"rows": 0, "groups": 0}
    one, _ = record_failure_groups(table.slice(2, 2))  # one position: shown as written
    assert one[0]["error"] == "not valid JSON: unexpected end of data: line 1 column 21 (char 20)"


# ---- F2, F3: ids and JSON Lines inputs ------------------------------------------------------

JSON_JOB = """\
name: notes
input:
  path: in.jsonl
  id: note_id
prompt: "Note: {{ body }}"
fields:
  mood: {type: enum, values: [good, bad]}
pool: pool.yaml
mode: direct
worker: fast
"""


def test_a_boolean_id_column_is_refused_naming_the_column_and_the_file(folder):
    (folder / "in.jsonl").write_text('{"note_id": true, "body": "a"}\n{"note_id": false, "body": "b"}\n')
    r = checked(folder, JSON_JOB)
    assert r.returncode == 2, r.stdout
    assert f"input {folder / 'in.jsonl'}: id column 'note_id' holds booleans" in r.stderr, r.stderr
    assert "one string or integer per row" in r.stderr


def test_an_empty_json_lines_file_has_no_rows(folder):
    for content in ("", "\n\n"):
        (folder / "in.jsonl").write_text(content)
        err = refused_at(folder, JSON_JOB, "path: in.jsonl")
        assert f"input.path: input {folder / 'in.jsonl'}: has no rows" in err, err
        assert "NDJSON" not in err and "infer" not in err


def test_an_empty_json_array_has_no_rows(folder):
    (folder / "in.json").write_text("[]\n")
    err = refused_at(folder, JSON_JOB.replace("in.jsonl", "in.json"), "path: in.json")
    assert f"input {folder / 'in.json'}: has no rows" in err, err


def test_a_json_line_that_is_not_an_object_is_refused_naming_its_line(folder):
    for odd, kind in (("[1, 2]", "an array"), ("5", "a number"), ("null", "null")):
        (folder / "in.jsonl").write_text(f'{{"note_id": "n1", "body": "a"}}\n\n{odd}\n')
        err = refused_at(folder, JSON_JOB, "path: in.jsonl")
        assert f"input {folder / 'in.jsonl'}: line 3 is not a JSON object (it holds {kind})" in err, err
        assert "supertype" not in err and "NDJSON" not in err


def test_a_json_line_giving_a_key_twice_is_refused_naming_the_line_and_the_key(folder):
    (folder / "in.jsonl").write_text('{"note_id": "n1", "body": "a"}\n{"note_id": "n2", "body": "b", "body": "c"}\n')
    err = refused_at(folder, JSON_JOB, "path: in.jsonl")
    assert f"input {folder / 'in.jsonl'}: line 2 gives the key 'body' twice" in err, err
    (folder / "in.jsonl").write_text('{"note_id": "n1", "body": "a"}\n{"note_id": "n2", "body": "b"}\n')
    assert checked(folder, JSON_JOB).returncode == 0


# ---- F5, F6: job-file keys ------------------------------------------------------------------

def test_a_typo_inside_a_join_entry_is_named_with_the_allowed_keys(folder):
    pq.write_table(pa.table({"kind": ["memo", "mail"], "dept": ["ops", "sales"]}), folder / "kinds.parquet")
    text = GOOD.replace("  carry: [kind]\n", "  carry: [kind]\n  join:\n    - {path: kinds.parquet, onn: kind}\n")
    err = refused_at(folder, text, "onn:")
    assert "input.join.0.onn: unknown key (allowed: path, on)" in err, err
    assert checked(folder, text.replace("onn:", "on:")).returncode == 0


def test_carrying_the_id_column_is_refused_saying_why(folder):
    text = GOOD.replace("carry: [kind]", "carry: [kind, note_id]")
    err = refused_at(folder, text, "carry:")
    assert "input.carry.1: 'note_id' is the id column, which every record holds already" in err, err


def test_a_field_description_that_is_not_text_is_refused(folder):
    text = GOOD.replace("amount: {type: number}", "amount: {type: number, description: 5}")
    err = refused_at(folder, text, "amount:")
    assert "fields.amount.description: must be a string (got 5)" in err, err


def test_rel_tol_with_an_exact_score_is_refused(folder):
    text = GOOD.replace("score: exact}", "score: exact, rel_tol: 0.01}")
    err = refused_at(folder, text, "rel_tol")
    assert "references.mood.rel_tol: only score: numeric takes rel_tol" in err, err
    assert checked(folder, GOOD.replace("score: exact}", "score: numeric, rel_tol: 0.01}")).returncode == 0


# ---- F7: numeric filters on a CSV column -----------------------------------------------------

def test_round_abs_and_sum_on_csv_text_are_refused_at_the_template_line(folder):
    (folder / "in.csv").write_text("note_id,kind,body,amount,gold_mood\nn1,memo,fine,1.5,good\nn2,mail,bad,-2,bad\n")
    base = GOOD.replace("path: in.parquet", "path: in.csv")
    for expr in ("amount | round", "amount|abs", "amount | sum", "(amount ~ '') | round(1)"):
        text = base.replace("  Note: {{ body }}", f"  Note: {{{{ body }}}}\n  Amount: {{{{ {expr} }}}}")
        err = refused_at(folder, text, "Amount:")
        name = re.search(r"(round|abs|sum)", expr).group(1)
        assert f"prompt: column 'amount' is given to `{name}`, which takes a number, but a CSV input is read " \
               f"as text" in err, err
        assert "{{ amount | float }}" in err and "TypeError" not in err
    fine = base.replace("  Note: {{ body }}", "  Note: {{ body }}\n  Amount: {{ amount | float | round(1) | abs }}")
    assert checked(folder, fine).returncode == 0
