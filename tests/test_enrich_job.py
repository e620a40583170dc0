"""Job files: a bad one is refused before any call, naming the file, the line and the key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conductor.enrich import load_job, render_queries
from conductor.enrich.table import load_rows
from conductor.errors import InputError
from tests.conftest import REPO, cli  # noqa: F401

GOOD = """\
name: notes
description: two fields from a note
input:
  path: in.parquet
  id: note_id
  carry: [kind]
prompt: |
  Kind: {{ kind }}
  Note: {{ body }}
fields:
  summary: {type: string, description: one sentence, required: true}
  mood: {type: enum, values: [good, bad]}
  amount: {type: number}
references:
  mood: {column: gold_mood, score: exact}
pool: pool.yaml
mode: direct
worker: fast
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    pq.write_table(pa.table({"note_id": ["n1", "n2", "n3"], "kind": ["memo", "memo", "mail"],
                             "body": ["all fine", "it broke", "so so"], "gold_mood": ["good", "bad", None]}),
                   tmp_path / "in.parquet")
    (tmp_path / "pool.yaml").write_text(textwrap.dedent("""\
        providers: {sim: {max_concurrency: 4}}
        workers:
          - {id: fast, model: openai/fast, provider: sim, api_base: "http://127.0.0.1:1/v1"}
        """))
    return tmp_path


def write(folder: Path, text: str, name: str = "job.yaml") -> Path:
    p = folder / name
    p.write_text(text)
    return p


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def refused(folder: Path, text: str) -> str:
    with pytest.raises(InputError) as e:
        load_job(write(folder, text))
    return str(e.value)


def test_good_job_loads_and_renders(folder):
    job = load_job(write(folder, GOOD))
    assert job.name == "notes" and job.template_names == ("body", "kind")
    assert [f.name for f in job.fields] == ["summary", "mood", "amount"]
    assert job.schema["required"] == ["summary", "mood", "amount"]  # strict shape on the wire
    assert job.check_schema == job.schema  # replies are validated against what was sent
    assert job.schema["properties"]["amount"]["type"] == ["number", "null"]  # optional: may be null
    q = render_queries(job)
    assert q.column("query_id").to_pylist() == ["n1", "n2", "n3"]
    assert q.column("prompt")[1].as_py() == "Kind: memo\nNote: it broke"
    assert q.column("task").to_pylist() == ["record"] * 3
    assert orjson.loads(q.column("reference")[0].as_py()) == {"mood": "good"}
    assert orjson.loads(q.column("reference")[2].as_py()) == {"mood": None}


def test_unknown_column_in_template_names_line(folder):
    text = GOOD.replace("Note: {{ body }}", "Note: {{ bodyy }}")
    msg = refused(folder, text)
    assert f"job.yaml:{line_of(text, 'bodyy')}: prompt:" in msg and "'bodyy'" in msg


def test_unknown_filter_in_template_names_line(folder):
    text = GOOD.replace("Note: {{ body }}", "Note: {{ body | nosuchfilter }}")
    msg = refused(folder, text)
    assert f"job.yaml:{line_of(text, 'nosuchfilter')}: prompt: template syntax error:" in msg
    assert "nosuchfilter" in msg


def test_a_name_that_clashes_with_a_fields_confidence_column_is_refused(folder):
    text = GOOD.replace("  amount: {type: number}", "  amount: {type: number}\n  amount_confidence: {type: string}")
    msg = refused(folder, text)
    assert f"job.yaml:{line_of(text, 'amount_confidence:')}: fields.amount_confidence:" in msg
    assert "confidence column of field 'amount'" in msg
    pq.write_table(pa.table({"note_id": ["n1"], "kind": ["memo"], "body": ["x"], "gold_mood": ["good"],
                             "amount_confidence": ["high"]}), folder / "in.parquet")
    msg = refused(folder, GOOD.replace("carry: [kind]", "carry: [kind, amount_confidence]"))
    assert "input.carry" in msg and "confidence column of field 'amount'" in msg


def test_a_key_given_twice_is_refused_with_both_lines(folder, tmp_path):
    text = GOOD.replace("worker: fast\n", "worker: fast\nworker: slow\n")
    msg = refused(folder, text)
    assert f"job.yaml:{line_of(text, 'worker: slow')}: worker: given twice (lines {line_of(text, 'worker: fast')}" in msg
    from conductor.errors import PoolError
    from conductor.pool import load_pool

    pool = tmp_path / "twice.yaml"
    pool.write_text("providers:\n  sim: {budget_usd: 1}\n  sim: {budget_usd: 100}\nworkers:\n  - {id: a, model: openai/a}\n")
    with pytest.raises(PoolError, match=r"twice.yaml:3: providers.sim: given twice \(lines 2 and 3\)"):
        load_pool(pool)


def test_numbers_in_exponent_form_are_numbers_in_job_and_pool_files_and_planner_options(folder):
    """PyYAML reads `1e-3` as the string '1e-3' (YAML 1.1 wants `1.0e-3`): a job with
    `budget_usd: 5e-1` and a pool price of `1.5e-1` were refused as "must be a number"."""
    from conductor.cli.options import parse_options
    from conductor.pool import load_pool

    pool = folder / "pool.yaml"  # priced first: a worker with no price cannot run under a budget
    pool.write_text(pool.read_text().replace('api_base: "http://127.0.0.1:1/v1"',
                                             'api_base: "http://127.0.0.1:1/v1", '
                                             'price: {input_per_mtok: 1.5e-1, output_per_mtok: 6E-1}'))
    job = load_job(write(folder, GOOD + "budget_usd: 5e-1\n"))
    assert job.budget_usd == 0.5
    price = load_pool(pool).workers[0].price
    assert (price.input * 1e6, price.output * 1e6) == pytest.approx((0.15, 0.6))
    assert parse_options(["cost_weight=1e3", "name=1e3x", "quoted='1e3'"]) == {"cost_weight": 1000.0, "name": "1e3x",
                                                                          "quoted": "1e3"}


def test_enum_values_that_yaml_reads_as_booleans_are_refused(folder):
    text = GOOD.replace("values: [good, bad]", "values: [yes, no]")
    msg = refused(folder, text)
    assert f"job.yaml:{line_of(text, 'values: [yes, no]')}: fields.mood.values: values must be text" in msg
    assert "True as a bool" in msg


def test_unknown_field_type(folder):
    text = GOOD.replace("{type: number}", "{type: decimal}")
    msg = refused(folder, text)
    assert f"job.yaml:{line_of(text, 'decimal')}: fields.amount.type:" in msg and "'decimal'" in msg


def test_enum_without_values(folder):
    text = GOOD.replace("{type: enum, values: [good, bad]}", "{type: enum}")
    msg = refused(folder, text)
    assert f"job.yaml:{line_of(text, 'mood: {type: enum}')}: fields.mood:" in msg and "values" in msg


def test_missing_reference_column(folder):
    text = GOOD.replace("column: gold_mood", "column: gold_feeling")
    msg = refused(folder, text)
    assert f"job.yaml:{line_of(text, 'gold_feeling')}: references.mood.column:" in msg
    assert "'gold_feeling'" in msg


def test_missing_id_column(folder):
    text = GOOD.replace("id: note_id", "id: nid")
    msg = refused(folder, text)
    assert f"job.yaml:{line_of(text, 'id: nid')}: input.id:" in msg and "'nid'" in msg


def test_duplicate_ids_named(folder):
    pq.write_table(pa.table({"note_id": ["n1", "n1", "n2"], "kind": ["a", "b", "c"], "body": ["x", "y", "z"],
                             "gold_mood": [None, None, None]}), folder / "in.parquet")
    job = load_job(write(folder, GOOD))
    with pytest.raises(InputError, match=r"duplicate id\(s\): 'n1'"):
        load_rows(job)


def test_empty_input_is_refused(folder):
    pq.write_table(pa.table({"note_id": pa.array([], pa.string()), "kind": pa.array([], pa.string()),
                             "body": pa.array([], pa.string()), "gold_mood": pa.array([], pa.string())}),
                   folder / "in.parquet")
    with pytest.raises(InputError, match="has no rows"):
        load_rows(load_job(write(folder, GOOD)))


@pytest.mark.parametrize("value", [".nan", ".inf", "-1"])
def test_a_budget_or_tolerance_that_is_no_finite_number_is_refused(folder, value):
    """YAML's .nan passes `< 0` and then makes every budget comparison false: no budget at all."""
    text = GOOD + f"budget_usd: {value}\n"
    assert f"job.yaml:{line_of(text, 'budget_usd')}: budget_usd: must be a finite number >= 0" in refused(folder, text)
    text = GOOD.replace("score: exact}", f"score: numeric, rel_tol: {value}}}")
    assert "references.mood.rel_tol: must be a finite number >= 0" in refused(folder, text)


def test_unknown_key_and_bad_worker(folder):
    text = GOOD.replace("mode: direct", "mdoe: direct")
    assert f"job.yaml:{line_of(text, 'mdoe')}: mdoe: unknown key" in refused(folder, text)
    text = GOOD.replace("worker: fast", "worker: huge")
    assert f"job.yaml:{line_of(text, 'worker: huge')}: worker:" in refused(folder, text)


def test_join_and_csv_input(folder):
    (folder / "in.csv").write_text("note_id,doc\nn1,d1\nn2,d2\n")
    pq.write_table(pa.table({"doc": ["d1", "d2"], "body": ["b1", "b2"]}), folder / "docs.parquet")
    text = GOOD.replace("path: in.parquet", "path: in.csv\n  join:\n    - {path: docs.parquet, on: doc}")
    text = text.replace("carry: [kind]", "carry: [doc]").replace("Kind: {{ kind }}", "Doc: {{ doc }}")
    text = text.replace("references:\n  mood: {column: gold_mood, score: exact}\n", "")
    job = load_job(write(folder, text))
    q = render_queries(job)
    assert q.column("prompt").to_pylist() == ["Doc: d1\nNote: b1", "Doc: d2\nNote: b2"]
    (folder / "in.csv").write_text("note_id,doc\nn1,d1\nn2,d9\n")
    with pytest.raises(InputError, match=r"no match on 'doc' \(keys 'd9'; ids 'n2'\)"):
        load_rows(job)
    # A CSV is read as text: its keys written as numbers match text keys, and integer keys too.
    (folder / "in.csv").write_text("note_id,doc\nn1,1\nn2,2\n")
    pq.write_table(pa.table({"doc": ["1", "2"], "body": ["b1", "b2"]}), folder / "docs.parquet")
    assert render_queries(job).column("prompt").to_pylist() == ["Doc: 1\nNote: b1", "Doc: 2\nNote: b2"]
    pq.write_table(pa.table({"doc": [1, 2], "body": ["b1", "b2"]}), folder / "docs.parquet")
    assert render_queries(job).column("prompt").to_pylist() == ["Doc: 1\nNote: b1", "Doc: 2\nNote: b2"]
    # Keys of two types (CSV text such as 01 against integers) are named, not a polars SchemaError.
    (folder / "in.csv").write_text("note_id,doc\nn1,01\nn2,02\n")
    with pytest.raises(InputError, match=r"join .*docs.parquet: key 'doc' is String in the input and Int64 there"):
        load_rows(job)


def test_csv_ids_written_with_leading_zeros_stay_text(folder):
    (folder / "in.csv").write_text("note_id,kind,body,gold_mood\n007,k,b,good\n008,k,c,bad\n")
    job = load_job(write(folder, GOOD.replace("path: in.parquet", "path: in.csv")))
    assert load_rows(job).get_column("note_id").to_list() == ["007", "008"]  # not 7 and 8
    (folder / "in.csv").write_text("note_id,kind,body,gold_mood\n7,k,b,good\n8,k,c,bad\n")
    assert load_rows(job).get_column("note_id").to_list() == [7, 8]  # integer ids stay integers
    (folder / "in.csv").write_text("nid,kind,body,gold_mood\n7,k,b,good\n")
    assert "input.id" in refused(folder, GOOD.replace("path: in.parquet", "path: in.csv"))


def test_ids_past_64_bits_are_read_as_text(folder):
    (folder / "in.jsonl").write_text('{"note_id": 12345678901234567890, "kind": "k", "body": "b", "gold_mood": null}\n'
                                     '{"note_id": 1, "kind": "k", "body": "c", "gold_mood": null}\n')
    job = load_job(write(folder, GOOD.replace("path: in.parquet", "path: in.jsonl")))
    assert render_queries(job).column("query_id").to_pylist() == ["12345678901234567890", "1"]
    assert load_rows(job).schema["note_id"] == pl.String


def test_cli_check_refuses_with_exit_code(folder):
    text = GOOD.replace("{type: number}", "{type: decimal}")
    p = write(folder, text)
    r = cli("job", "check", p)
    assert r.returncode == 2 and "fields.amount.type" in r.stderr and "decimal" in r.stderr
    r = cli("job", "check", write(folder, GOOD))
    assert r.returncode == 0, r.stderr
    assert "3 rows" in r.stdout


def test_judge_needs_a_pool_worker_and_a_rubric(folder):
    text = GOOD.replace("worker: fast\n", "worker: fast\nquality:\n  judge: {worker: big, rubric: be right}\n")
    assert f"job.yaml:{line_of(text, 'judge:')}: quality.judge.worker:" in refused(folder, text)
    text = GOOD.replace("worker: fast\n", "worker: fast\nquality:\n  judge: {worker: fast}\n")
    assert "quality.judge: the judge needs a rubric" in refused(folder, text)


def test_json_lines_and_a_folder_of_parquet_files(folder):
    (folder / "in.jsonl").write_text('{"note_id": "n1", "kind": "memo", "body": "b1", "gold_mood": "good"}\n'
                                     '{"note_id": "n2", "kind": "mail", "body": "b2", "gold_mood": null}\n')
    job = load_job(write(folder, GOOD.replace("path: in.parquet", "path: in.jsonl")))
    assert render_queries(job).column("prompt").to_pylist() == ["Kind: memo\nNote: b1", "Kind: mail\nNote: b2"]
    parts = folder / "parts"
    parts.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"note_id": [f"p{i}"], "kind": ["k"], "body": [f"x{i}"], "gold_mood": ["bad"]}),
                       parts / f"part-{i}.parquet")
    job = load_job(write(folder, GOOD.replace("path: in.parquet", "path: parts")))
    assert render_queries(job).column("query_id").to_pylist() == ["p0", "p1", "p2"]
    # A .json file holding one array of objects, as many exports write it.
    (folder / "in.json").write_text('[{"note_id": "j1", "kind": "memo", "body": "b1", "gold_mood": "good"}]')
    job = load_job(write(folder, GOOD.replace("path: in.parquet", "path: in.json")))
    assert render_queries(job).column("prompt").to_pylist() == ["Kind: memo\nNote: b1"]
    # A CSV saved as Latin-1: the file and the line, not polars' "invalid utf-8 sequence".
    (folder / "latin.csv").write_bytes("note_id,kind,body,gold_mood\nn1,memo,ok,good\nn2,memo,caf\xe9,bad\n"
                                       .encode("latin-1"))
    job = load_job(write(folder, GOOD.replace("path: in.parquet", "path: latin.csv")))
    with pytest.raises(InputError, match=f"input {folder / 'latin.csv'}: line 3 is not valid UTF-8"):
        render_queries(job)
    text = GOOD.replace("path: in.parquet", "path: in.xlsx")
    (folder / "in.xlsx").write_text("x")
    assert f"job.yaml:{line_of(text, 'in.xlsx')}: input.path:" in refused(folder, text)


def test_an_abandoned_run_hands_the_batches_it_never_collected_to_the_new_run(tmp_path):
    """A job run killed with a batch in flight, then superseded, said "$0 for 0 calls" and
    nothing in flight, while the provider billed the whole batch and the new run paid for
    those rows again (audit 28). The new run's batch journal now holds those batches, so it
    polls them for the same requests (tests/test_batch.py runs that end to end)."""
    from conductor.execute.batchfiles import BatchJournal
    from conductor.cli.render import job_summary
    from conductor.enrich.history import abandon_interrupted

    run = tmp_path / "runs" / "qa-old"
    (run / "work").mkdir(parents=True)
    pq.write_table(pa.table({"query_id": ["a", "b", "c"]}), run / "queries.parquet")
    (run / "manifest.json").write_bytes(orjson.dumps({"run_id": "qa-old", "status": "executing",
                                                      "job": {"name": "qa"}}))
    lines = [{"event": "uploaded", "input_file_id": "file-1", "worker": "w", "keys": ["k1", "k2"], "reserved": 0.25},
             {"event": "submitted", "batch_id": "batch_1", "input_file_id": "file-1", "worker": "w",
              "keys": ["k1", "k2"], "reserved": 0.25},
             {"event": "uploaded", "input_file_id": "file-2", "worker": "w", "keys": ["k3"], "reserved": 0.5}]
    (run / "work" / "batches.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    (closed,) = abandon_interrupted(tmp_path, "qa", "qa-new")
    assert closed["lost_in_flight"] == {"calls": 0, "unpriced_calls": 0, "reserved_usd": 0.0}
    assert closed["batches_in_flight"] == ["batch_1", "file-2"]
    handed = BatchJournal(tmp_path / "runs" / "qa-new" / "work")
    assert list(handed.open) == ["batch_1"] and handed.open["batch_1"]["keys"] == ["k1", "k2"]
    assert list(handed.uploaded) == ["file-2"] and handed.open["batch_1"]["adopted_from"] == "qa-old"
    assert orjson.loads((run / "manifest.json").read_bytes())["status"] == "abandoned"
    shown = job_summary({"job": "qa", "run_id": "qa-new", "rows": 0, "computed": 0, "reused": 0, "valid": 0,
                         "statuses": {}, "cost_usd": 0.0, "calls": 0, "metrics": {"valid_share": 1.0, "fields": {}},
                         "abandoned_runs": [closed], "wall_time_s": 1.0, "records_path": "r", "catalog": "c"})
    assert "its batches in flight (batch_1, file-2) were handed to this run" in shown
