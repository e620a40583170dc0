"""The job file's contract, kept before any call: names SQL would confuse (case), keys that do
nothing where they are, YAML syntax errors at their line; prompts no run can send (blank, or
over the instruction limit); and input values that reach prompts and hashes as written, so
that a grown CSV or JSON input sends only its new rows."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.enrich import load_job, render_queries
from conductor.enrich.table import load_rows, render, row_hashes
from conductor.errors import InputError, PoolError
from conductor.plans import MAX_INSTRUCTION_CHARS
from tests.conftest import cli, worker
from tests.test_enrich_job import line_of, refused, write

JOB = """\
name: notes
input:
  path: in.parquet
  id: note_id
  carry: [kind]
prompt: |
  Kind: {{ kind }}
  Note: {{ body }}
fields:
  summary: {type: string}
  mood: {type: enum, values: [good, bad]}
pool: pool.yaml
mode: direct
worker: fast
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    pq.write_table(pa.table({"note_id": ["n1", "n2"], "kind": ["memo", "mail"], "body": ["fine", "broke"],
                             "Status": ["new", "old"], "text": ["t1", "t2"]}), tmp_path / "in.parquet")
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump({
        "providers": {"sim": {"max_concurrency": 4}},
        "workers": [{"id": "fast", "model": "openai/fast", "provider": "sim", "api_base": "http://127.0.0.1:1/v1"}]}))
    return tmp_path


# ---- F1: record column names, ignoring case --------------------------------------

@pytest.mark.parametrize("change, needle, key, clash", [
    (("  mood: {type: enum, values: [good, bad]}", "  Status: {type: string}"), "Status:", "fields.Status",
     "field 'Status' clashes with the record column 'status' (SQL ignores case)"),
    (("  mood: {type: enum, values: [good, bad]}", "  SCORE: {type: number}"), "SCORE:", "fields.SCORE",
     "the record column 'score'"),
    (("carry: [kind]", "carry: [kind, Status]"), "carry:", "input.carry.1",
     "carried column 'Status' clashes with the record column 'status'"),
    (("  mood: {type: enum, values: [good, bad]}", "  Summary: {type: string}"), "Summary:", "fields.Summary",
     "field 'Summary' clashes with field 'summary'"),
    (("  mood: {type: enum, values: [good, bad]}", "  Kind: {type: string}"), "Kind: {type", "fields.Kind",
     "field 'Kind' clashes with carried column 'kind'"),
    (("  mood: {type: enum, values: [good, bad]}", "  NOTE_ID: {type: string}"), "NOTE_ID:", "fields.NOTE_ID",
     "field 'NOTE_ID' clashes with id column 'note_id'"),
    (("carry: [kind]", "carry: [kind, text]"), "carry:", "input.carry.1", None),  # distinct: accepted
])
def test_names_that_differ_only_in_case_from_a_record_column_or_each_other_are_refused(folder, change, needle,
                                                                                       key, clash):
    text = JOB.replace(*change)
    if clash is None:
        assert load_job(write(folder, text)).carry == ("kind", "text")
        return
    msg = refused(folder, text)
    assert f"job.yaml:{line_of(text, needle)}: {key}: " in msg and clash in msg and msg.endswith("; rename it")


def test_a_case_clash_is_refused_by_check_and_run_before_anything_is_written(folder):
    p = write(folder, JOB.replace("carry: [kind]", "carry: [kind, Status]"))
    for args in (("job", "check", p), ("job", "run", p, "--data-dir", folder / "data", "--quiet")):
        r = cli(*args)
        assert r.returncode == 2 and "input.carry.1: carried column 'Status' clashes" in r.stderr
    assert not (folder / "data" / "runs").exists()


def test_a_confidence_column_differing_in_case_and_a_carried_column_given_twice_are_refused(folder):
    text = JOB.replace("  mood: {type: enum, values: [good, bad]}", "  Summary_Confidence: {type: number}")
    msg = refused(folder, text)
    assert f":{line_of(text, 'Summary_Confidence')}: fields.Summary_Confidence: field 'Summary_Confidence' " \
           f"clashes with the confidence column of field 'summary'" in msg
    msg = refused(folder, JOB.replace("carry: [kind]", "carry: [kind, kind]"))
    assert "input.carry.1: carried column 'kind' is listed twice; keep one" in msg
    msg = refused(folder, JOB.replace("carry: [kind]", "carry: [kind, note_id]"))
    assert "input.carry.1: 'note_id' is the id column, which every record holds already" in msg


def test_an_id_column_named_like_a_record_column_is_refused(folder):
    """records.parquet would hold the run's `status` where the ids belong."""
    text = JOB.replace("id: note_id", "id: Status")
    assert f"job.yaml:{line_of(text, 'id: Status')}: input.id: id column 'Status' clashes with the record " \
           f"column 'status'" in refused(folder, text)


# ---- F7: items and fields only where they apply ------------------------------------

@pytest.mark.parametrize("spec, key, message", [
    ("{type: string, items: number}", "items", "only a list takes items (this field is string)"),
    ("{type: string, fields: {x: {type: number}}}", "fields", "only an object takes fields (this field is string)"),
    ("{type: number, items: string}", "items", "only a list takes items (this field is number)"),
    ("{type: list, fields: {x: {type: number}}}", "fields", "only an object takes fields (this field is list)"),
])
def test_items_or_fields_on_a_field_of_another_type_are_refused(folder, spec, key, message):
    text = JOB.replace("  summary: {type: string}", f"  summary: {spec}")
    assert f"job.yaml:{line_of(text, 'summary:')}: fields.summary.{key}: {message}" in refused(folder, text)


# ---- F8: YAML syntax errors at FILE:LINE:COL ------------------------------------------

@pytest.mark.parametrize("broken, at, problem", [
    (("  mood: {type: enum", " mood: {type: enum"), "11:2",
     "expected <block end>, but found '<block mapping start>' (while parsing a block mapping that starts at line 1, "
     "column 1)"),
    (("  mood: {type: enum", "\tmood: {type: enum"), "11:1",
     "found character '\\t' that cannot start any token (while scanning for the next token)"),
    (("  summary: {type: string}", '  summary: {type: string, description: "oops}'), "15:1",
     "found unexpected end of stream (while scanning a quoted scalar that starts at line 10, column 40)"),
])
def test_a_yaml_syntax_error_names_file_line_and_column_on_one_line(folder, broken, at, problem):
    p = write(folder, JOB.replace(*broken))
    with pytest.raises(InputError) as e:
        load_job(p)
    msg = str(e.value)
    assert msg == f"job file {p}:{at}: not valid YAML: {problem}", msg
    assert "\n" not in msg and "<unicode string>" not in msg
    r = cli("job", "check", p)
    assert r.returncode == 2 and f"{p}:{at}: not valid YAML" in r.stderr


def test_a_pool_file_syntax_error_reads_the_same_way(tmp_path):
    from conductor.pool import load_pool

    f = tmp_path / "pool.yaml"
    f.write_text("workers:\n  - {id: a, model: openai/a\n")
    with pytest.raises(PoolError) as e:
        load_pool(f)
    assert str(e.value).startswith(f"pool file {f}:3:1: not valid YAML: ") and "\n" not in str(e.value)


# ---- F4, F5: prompts no run can send -----------------------------------------------

PLAIN = """\
name: odd
input: {path: odd.parquet, id: id}
prompt: "{{ text }}"
fields:
  summary: {type: string}
pool: pool.yaml
mode: direct
worker: fast
"""


def odd_job(folder: Path, texts: list[str | None]) -> Path:
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(texts))], "text": pa.array(texts, pa.string())}),
                   folder / "odd.parquet")
    return write(folder, PLAIN, "odd.yaml")


def test_rows_that_render_an_empty_prompt_are_refused_by_check_and_run_naming_them(folder):
    p = odd_job(folder, ["fine", None, "", "  \n ", "also fine"])
    for args in (("job", "check", p), ("job", "run", p, "--data-dir", folder / "data", "--quiet")):
        r = cli(*args)
        assert r.returncode == 2, r.stdout
        assert f"job {p}: input {folder / 'odd.parquet'}: 3 row(s) render an empty prompt (id 'r1', 'r2', 'r3'); " \
               "filter them out of the input, or give the template a fallback" in r.stderr
        assert "queries.parquet" not in r.stderr
    assert not (folder / "data" / "runs").exists()  # no orphan run folder
    p = odd_job(folder, [None] * 8)
    assert "8 row(s) render an empty prompt (id 'r0', 'r1', 'r2', 'r3', 'r4' and 3 more)" in cli("job", "check",
                                                                                                  p).stderr


def test_the_fallback_the_message_suggests_renders_every_row(folder):
    p = odd_job(folder, ["fine", None, "", "  \n "])
    p.write_text(PLAIN.replace('"{{ text }}"', "\"{{ (text or '') | trim or '(empty)' }}\""))
    job = load_job(p)
    assert render(job, load_rows(job)) == ["fine", "(empty)", "(empty)", "(empty)"]


def test_a_prompt_over_the_instruction_limit_is_refused_before_any_call_naming_the_row(folder):
    p = odd_job(folder, ["short", "x" * MAX_INSTRUCTION_CHARS, "y" * (MAX_INSTRUCTION_CHARS + 5)])
    r = cli("job", "check", p)
    assert r.returncode == 2
    assert f"1 row(s) render a prompt longer than {MAX_INSTRUCTION_CHARS:,} characters" in r.stderr
    assert "(id 'r2' (100,005 characters)); shorten their text or filter them out of the input" in r.stderr
    r = cli("job", "run", p, "--data-dir", folder / "data", "--quiet")
    assert r.returncode == 2 and "'r2' (100,005 characters)" in r.stderr
    assert not (folder / "data" / "runs").exists()
    planned = PLAIN.replace("mode: direct\nworker: fast\n", "mode: planned\n")
    p.write_text(planned)  # the embedded planner sends the prompt as the step's instruction too
    assert "'r2' (100,005 characters)" in cli("job", "check", p).stderr


# ---- F3: input values as written --------------------------------------------------------

CSV_JOB = """\
name: csvjob
input: {path: INPUT, id: id, carry: [zip, amount]}
prompt: "ZIP {{ zip }} amount {{ amount }} note {{ note }}"
fields:
  city: {type: string}
pool: pool.yaml
mode: direct
worker: fast
"""


def csv_job(folder: Path, path: str = "in.csv") -> Path:
    return write(folder, CSV_JOB.replace("INPUT", path), "csv.yaml")


def prompts_and_hashes(path: Path) -> tuple[list[str], list[str]]:
    job = load_job(path)
    df = load_rows(job)
    return render(job, df), row_hashes(job, df, "definition")


def test_csv_columns_are_read_as_text_exactly_as_written(folder):
    (folder / "in.csv").write_text('id,zip,amount,note\n1,00501,12,hello\n2,02134,7.50,world\n'
                                   '3,10001,30,"two\nlines"\n')
    job = load_job(csv_job(folder))
    rows = load_rows(job)
    assert rows.get_column("id").to_list() == [1, 2, 3]  # ids written as integers stay integers
    assert rows.get_column("zip").to_list() == ["00501", "02134", "10001"]  # carried as text
    assert rows.get_column("amount").to_list() == ["12", "7.50", "30"]
    assert render_queries(job).column("prompt").to_pylist()[:2] == ["ZIP 00501 amount 12 note hello",
                                                                    "ZIP 02134 amount 7.50 note world"]


def test_an_appended_csv_row_with_a_decimal_leaves_the_other_rows_prompts_and_hashes(folder):
    (folder / "in.csv").write_text("id,zip,amount,note\n1,00501,12,hello\n2,02134,7,world\n")
    before = prompts_and_hashes(csv_job(folder))
    with open(folder / "in.csv", "a") as f:
        f.write("3,99999,1.5,new row\n")
    prompts, hashes = prompts_and_hashes(csv_job(folder))
    assert (prompts[:2], hashes[:2]) == before and prompts[2] == "ZIP 99999 amount 1.5 note new row"


@pytest.mark.parametrize("layout", ["one file", "folder", "json array"])
def test_json_integers_keep_rendering_and_hashing_as_integers_when_a_decimal_arrives(folder, layout):
    first = [{"id": 1, "zip": "00501", "amount": 12, "note": "a"}, {"id": 2, "zip": "02134", "amount": 7, "note": "b"}]
    later = [{"id": 3, "zip": "99999", "amount": 2.5, "note": "c"}, {"id": 4, "zip": "1", "amount": 3, "note": "d"}]

    def save(rows_by_file: list[list[dict]]) -> str:
        if layout == "json array":
            (folder / "in.json").write_text(orjson.dumps([r for rows in rows_by_file for r in rows]).decode())
            return "in.json"
        if layout == "one file":
            (folder / "in.jsonl").write_text("".join(orjson.dumps(r).decode() + "\n"
                                                     for rows in rows_by_file for r in rows))
            return "in.jsonl"
        (folder / "days").mkdir(exist_ok=True)
        for i, rows in enumerate(rows_by_file):
            (folder / "days" / f"day{i}.jsonl").write_text("".join(orjson.dumps(r).decode() + "\n" for r in rows))
        return "days"

    before = prompts_and_hashes(csv_job(folder, save([first])))
    assert before[0] == ["ZIP 00501 amount 12 note a", "ZIP 02134 amount 7 note b"]
    prompts, hashes = prompts_and_hashes(csv_job(folder, save([first, later])))
    assert prompts == before[0] + ["ZIP 99999 amount 2.5 note c", "ZIP 1 amount 3 note d"]
    assert hashes[:2] == before[1]


def test_json_floats_written_as_floats_and_parquet_values_render_and_hash_as_before(folder):
    """Only integers a relaxed JSON column holds change: 7.0 written so stays 7.0, and a Parquet
    job's prompts and hashes are byte for byte those of earlier versions (no row is paid again)."""
    (folder / "in.jsonl").write_text('{"id": 1, "zip": "a", "amount": 7.0, "note": "x"}\n'
                                     '{"id": 2, "zip": "b", "amount": 2.5, "note": "y"}\n')
    assert prompts_and_hashes(csv_job(folder, "in.jsonl"))[0] == ["ZIP a amount 7.0 note x",
                                                                  "ZIP b amount 2.5 note y"]
    values = {"id": [1, 2], "zip": ["00501", None], "amount": [7.0, 2.5], "note": ["x", "y"]}
    pq.write_table(pa.table(values), folder / "in.parquet")
    prompts, hashes = prompts_and_hashes(csv_job(folder, "in.parquet"))
    assert prompts == ["ZIP 00501 amount 7.0 note x", "ZIP  amount 2.5 note y"]
    names = ("amount", "note", "zip")  # the template's columns, sorted
    assert hashes == [hashlib.sha256(b"definition\0" + orjson.dumps([values[n][i] for n in names])).hexdigest()[:32]
                      for i in range(2)]


@pytest.mark.parametrize("template, column, how", [
    ("double {{ amount * 2 }}", "amount", "in arithmetic"),
    ("{{ -amount }}", "amount", "in arithmetic"),
    ("{% if amount == 0 %}zero{% endif %}", "amount", "compared as a number"),
    ("{% if 10 < amount %}big{% endif %}", "amount", "compared as a number"),
    ("{{ zip }}\n{% if zip > note %}after{% endif %}", "zip", "compared as a number"),
    ("{{ [amount, zip] | max }}", "amount", "ordered with `max`"),
    ("{{ amount | sort }}", "amount", "ordered with `sort`"),
])
def test_a_csv_column_computed_with_as_it_is_is_refused_at_its_line(folder, template, column, how):
    """Read as text, `amount * 2` repeats '12.50' and `amount == 0` is never true: silently, and paid.
    (Audit40: inferred as numbers before, such templates worked.)"""
    (folder / "in.csv").write_text("id,zip,amount,note\n1,00501,12.50,hello\n")
    text = CSV_JOB.replace("INPUT", "in.csv").replace(
        '"ZIP {{ zip }} amount {{ amount }} note {{ note }}"', "|\n  " + template.replace("\n", "\n  "))
    path = write(folder, text, "csv.yaml")
    with pytest.raises(InputError) as e:
        load_job(path)
    line = line_of(text, "prompt:") + 1 + template.count("\n")
    assert str(e.value).startswith(f"job file {path}:{line}: prompt: column {column!r} is {how}, but a CSV "
                                   f"input is read as text"), str(e.value)
    assert f"{{{{ {column} | float }}}}" in str(e.value)


@pytest.mark.parametrize("template", [
    "double {{ amount | float * 2 }}",
    "{% if (amount | float) == 0 %}zero{% endif %}",
    "{% if note == 'hello' %}hi{% endif %} {% if note %}{{ note }}{% endif %} {{ id * 1 }}",
    "{{ zip ~ note }}",
])
def test_converted_text_comparisons_and_a_parquet_input_are_left_alone(folder, template):
    (folder / "in.csv").write_text("id,zip,amount,note\n1,00501,12.50,hello\n")
    text = CSV_JOB.replace('"ZIP {{ zip }} amount {{ amount }} note {{ note }}"', repr(template).replace("'", '"')
                           if "'" not in template else '"' + template + '"')
    load_job(write(folder, text.replace("INPUT", "in.csv"), "csv.yaml"))
    pq.write_table(pa.table({"id": [1], "zip": ["00501"], "amount": [12.5], "note": ["hello"]}), folder / "p.parquet")
    load_job(write(folder, CSV_JOB.replace("INPUT", "p.parquet").replace(
        '"ZIP {{ zip }} amount {{ amount }} note {{ note }}"', '"{{ amount * 2 }} {% if amount == 0 %}z{% endif %}"'),
        "pq.yaml"))


def test_a_grown_csv_sends_only_its_new_row_and_carries_text(fresh_sim, tmp_path):
    """End to end over HTTP: the audit's case, where the appended 1.5 re-sent every row."""
    sim = fresh_sim
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump({"providers": {"sim": {"max_concurrency": 4, "timeout_s": 10}},
                                                        "workers": [worker("fast", sim.url)]}))
    (tmp_path / "in.csv").write_text(textwrap.dedent("""\
        id,zip,amount,note
        1,00501,12,hello
        2,02134,7,world
        3,10001,30,again
        """))
    from conductor.enrich.run import run_job

    path = csv_job(tmp_path)
    first = run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    assert first["computed"] == 3 and sim.log()["total"] == 3
    with open(tmp_path / "in.csv", "a") as f:
        f.write("4,99999,1.5,new row\n")
    sim.reset()
    second = run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    assert (second["computed"], second["reused"], sim.log()["total"]) == (1, 3, 1)
    rec = pq.read_table(second["records_path"])
    assert rec.schema.field("zip").type == pa.string() and rec.schema.field("id").type == pa.int64()
    assert rec.column("zip").to_pylist() == ["00501", "02134", "10001", "99999"]
    assert rec.column("amount").to_pylist() == ["12", "7", "30", "1.5"]
