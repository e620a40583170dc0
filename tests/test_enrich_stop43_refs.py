"""fix43d (fix42h, carried): scale_field, scale_column and type_column, which only `score: tatqa`
reads, were ignored in silence on a reference scored otherwise, as rel_tol was before stop 42. So
were, in effect: a scale
field that is not an enum of TAT-QA's scales (a list one crashed the scoring after every call was
paid; `scale_field: [scale]` crashed `job check`), gold scales TAT-QA does not know (counted as
none), and `score: numeric` on a field that is never a number (every row scored 0). Each is refused
by `job run` before any call, naming the job file, the line, the key and what to do."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.enrich import load_job, render_queries
from conductor.enrich.run import run_job
from conductor.sim import start_sim
from tests.conftest import cli, worker, write_pool

SCALES = ["", "thousand", "million", "billion", "percent"]
FIELDS = {"answer": {"type": "list", "required": True},
          "scale": {"type": "enum", "values": SCALES, "required": True},
          "num": {"type": "number"}, "flag": {"type": "boolean"}, "day": {"type": "date"},
          "kind": {"type": "string"}, "item": {"type": "object", "fields": {"a": {"type": "number"}}}}
BOTH = {"column": "gold", "score": "tatqa", "scale_field": "scale", "scale_column": "gold_scale"}


def write_input(folder: Path, scales: list | None = None) -> None:
    pq.write_table(pa.table({
        "qid": ["q1", "q2", "q3", "q4"], "doc_id": ["d1", "d1", "d2", "d2"],
        "question": ["What was revenue?", "What contract type?", "What was the margin?", "How many segments?"],
        "gold": ['["1,496.5"]', '["fixed-price type"]', '["12.4"]', '["3"]'],
        "gold_scale": scales if scales is not None else ["million", "", "percent", None],
        "gold_type": ["span", "span", "arithmetic", "count"], "gold_num": ["1496.5", "2", "12.4", "3"]}),
        folder / "in.parquet")


def write_job(folder: Path, url: str, refs: dict, fields: dict | None = None, **changes) -> Path:
    """A job whose references are written one key a line, so each key has a line of its own."""
    if not (folder / "in.parquet").exists():
        write_input(folder)
    write_pool(folder / "pool.yaml", url, names=("fast",))
    doc = {"name": "qa", "input": {"path": "in.parquet", "id": "qid"}, "prompt": "Q: {{ question }}",
           "fields": fields or FIELDS, "references": refs, "pool": "pool.yaml", "worker": "fast", **changes}
    (folder / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False))
    return folder / "job.yaml"


def line_of(path: Path, needle: str) -> int:
    found = [i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line]
    assert len(found) == 1, (needle, found)
    return found[0]


def refused_run(sim, path: Path, needle: str, words: str) -> str:
    """`job run` refuses the file at the needle's line before any call: no run folder, no request."""
    data, sent = path.parent / "data", sim.log()["total"]
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert f"job file {path}:{line_of(path, needle)}: {words}" in r.stderr, r.stderr
    assert not (data / "runs").exists() and sim.log()["total"] == sent
    assert cli("job", "check", path).stderr == r.stderr  # `job check` says the same
    return r.stderr


# ---- the keys only tatqa reads, on every other scorer ----------------------------------------------

ON = {"scale_field": "scale", "scale_column": "gold_scale", "type_column": "gold_type"}


@pytest.mark.parametrize("score", ["exact", "numeric", "f1", "set"])
@pytest.mark.parametrize("key", list(ON))
def test_a_tatqa_key_on_another_scorer_is_refused_before_any_call(fresh_sim, tmp_path, score, key):
    field, column = ("num", "gold_num") if score == "numeric" else ("answer", "gold")
    path = write_job(tmp_path, fresh_sim.url, {field: {"column": column, "score": score, key: ON[key]}})
    refused_run(fresh_sim, path, f"{key}:", f"references.{field}.{key}: only score: tatqa takes {key} (this "
                                           f"reference is scored {score}, which does not use it); set score: "
                                           f"tatqa, or remove {key}")


def test_the_tatqa_keys_are_still_taken_by_tatqa_with_both_scales_or_with_neither(fresh_sim, tmp_path):
    for refs in ({"answer": {**BOTH, "type_column": "gold_type"}}, {"answer": {"column": "gold", "score": "tatqa"}},
                 {"answer": {"column": "gold", "score": "tatqa", "type_column": "gold_type"}}):
        r = cli("job", "check", write_job(tmp_path, fresh_sim.url, refs))
        assert r.returncode == 0, r.stderr


# ---- tatqa: the record's scale an enum of TAT-QA's scales, the gold ones known ----

def test_a_scale_on_one_side_only_is_taken(fresh_sim, tmp_path):
    """The other side may be written out in full units already (gold 1500000 for an answer of 1.5
    million scores right): review43 1."""
    for key in ("scale_field", "scale_column"):
        refs = {"answer": {"column": "gold", "score": "tatqa", key: ON[key]}}
        r = cli("job", "check", write_job(tmp_path, fresh_sim.url, refs))
        assert r.returncode == 0, r.stderr


def test_a_scale_field_that_is_not_an_enum_of_tatqa_scales_is_refused(fresh_sim, tmp_path):
    """A list scale field crashed the scoring (unhashable) once every call was paid for; a string
    or number one counted any scale as none."""
    for name in ("answer", "kind", "num"):
        path = write_job(tmp_path, fresh_sim.url, {"answer": {**BOTH, "scale_field": name}})
        err = refused_run(fresh_sim, path, "scale_field:", f"references.answer.scale_field: field {name!r} is a "
                                                           f"{FIELDS[name]['type']}; the record's scale must be an "
                                                           f"enum field of TAT-QA's scales ('', thousand, million, "
                                                           f"billion, percent)")
        assert 'e.g. {type: enum, values: ["", thousand, million, billion, percent]}' in err
    fields = {**FIELDS, "scale": {"type": "enum", "values": ["", "thousands", "Million", "percent"]}}
    path = write_job(tmp_path, fresh_sim.url, {"answer": BOTH}, fields=fields)
    refused_run(fresh_sim, path, "scale_field:", "references.answer.scale_field: field 'scale' has values that are "
                                                 "not TAT-QA's scales ('thousands', 'Million'): a record giving one "
                                                 "would count as having no scale; keep its values among '', "
                                                 "thousand, million, billion, percent")


def test_gold_scales_tatqa_does_not_know_are_refused_naming_the_file_and_the_values(fresh_sim, tmp_path):
    write_input(tmp_path, scales=["Million", "", "m", None])
    path = write_job(tmp_path, fresh_sim.url, {"answer": BOTH})
    refused_run(fresh_sim, path, "scale_column:", f"references.answer.scale_column: column 'gold_scale' of "
                                                  f"{tmp_path / 'in.parquet'} holds 'Million', 'm'; TAT-QA's scales "
                                                  f"are '', thousand, million, billion, percent, and a row's answer "
                                                  f"with another would count as having no scale; write each as one "
                                                  f"of those")
    write_input(tmp_path, scales=[6, 0, 3, None])
    refused_run(fresh_sim, path, "scale_column:", "references.answer.scale_column: column 'gold_scale' of "
                                                  f"{tmp_path / 'in.parquet'} holds Int64 values; TAT-QA's scales "
                                                  f"are ''")


def test_a_tatqa_key_that_is_not_a_name_is_refused(fresh_sim, tmp_path):
    """`scale_field: [scale]` crashed `job check` and `job run` (TypeError: unhashable type)."""
    for key, value, what in (("scale_field", ["scale"], "a field (got ['scale'])"),
                             ("scale_column", 5, "an input column (got 5)"),
                             ("type_column", None, "an input column (got None)")):
        path = write_job(tmp_path, fresh_sim.url, {"answer": {**BOTH, key: value}})
        refused_run(fresh_sim, path, f"{key}:", f"references.answer.{key}: must be the name of {what}")
    path = write_job(tmp_path, fresh_sim.url, {"answer": {**BOTH, "type_column": "gold_kind"}})
    refused_run(fresh_sim, path, "type_column:", "references.answer.type_column: 'gold_kind' is not in the input "
                                                 "(columns: qid, doc_id, question, gold, gold_scale, gold_type, "
                                                 "gold_num)")


# ---- numeric on a field that is never a number ---------------------------------------------------

def test_numeric_on_a_field_never_read_as_a_number_is_refused(fresh_sim, tmp_path):
    """Every row scored 0: score.to_number reads no number from a list, an object, true or a date."""
    for name, instead in (("answer", "set"), ("flag", "exact"), ("day", "exact"), ("item", "exact")):
        path = write_job(tmp_path, fresh_sim.url, {name: {"column": "gold", "score": "numeric"}})
        refused_run(fresh_sim, path, "score: numeric", f"references.{name}.score: score: numeric compares numbers, "
                                                       f"and field {name!r} is a {FIELDS[name]['type']}, which is "
                                                       f"never read as one: every row would score 0; use score: "
                                                       f"{instead}")
    for name in ("num", "kind"):  # a number, or text that holds one ("1,496.5")
        assert cli("job", "check", write_job(tmp_path, fresh_sim.url, {name: {"column": "gold_num",
                                                                               "score": "numeric"}})).returncode == 0


# ---- a real run: the gold scale read from a join table, both scales honoured ---------------------

def test_tatqa_reads_the_gold_scale_from_a_join_table_and_scores_scaled_answers(tmp_path):
    write_input(tmp_path, scales=["million", "", "percent", ""])
    table = pq.read_table(tmp_path / "in.parquet")
    pq.write_table(table.drop_columns(["gold_scale"]), tmp_path / "in.parquet")
    pq.write_table(table.select(["qid", "gold_scale"]), tmp_path / "scales.parquet")
    refs = {"answer": {**BOTH, "type_column": "gold_type"}, "scale": {"column": "gold_scale", "score": "exact"}}
    fields = {"answer": FIELDS["answer"], "scale": FIELDS["scale"]}
    join = {"input": {"path": "in.parquet", "id": "qid", "join": [{"path": "scales.parquet", "on": "qid"}]}}
    path = write_job(tmp_path, "http://127.0.0.1:9/v1", refs, fields=fields, **join)  # the sim's address comes later
    queries = tmp_path / "queries.parquet"
    pq.write_table(render_queries(load_job(path)), queries)
    (tmp_path / "server.yaml").write_text(yaml.safe_dump({"workers": [
        {"id": "fast", "model": "openai/fast", "simulate": {"skill": {"record": 1.0}}}]}))
    with start_sim(tmp_path / "server.yaml", queries, latency_ms=0) as sim:
        write_pool(tmp_path / "pool.yaml", sim.url, workers=[worker("fast", sim.url)])
        s = run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
        assert sim.log()["total"] == 4
    records = pq.read_table(s["records_path"]).to_pylist()
    assert [r["scale"] for r in records] == ["million", "", "percent", ""]
    answer = s["metrics"]["fields"]["answer"]
    assert answer["scored_rows"] == 4 and answer["em"] == answer["f1"] == answer["accuracy"] == 1.0, answer
