"""audit71 F2: DuckDB reads column names without regard to case, so a query-set column `Status` carried
as it was made `SELECT Status FROM results` return conductor's status, the user's column showing up as
`Status_1`. Such a column is carried as `input_Status`; two carried columns that differ only in case
are refused, naming both, before anything runs. And a worker, access entry or condition step of 19 to
4,300 digits (Python reads those as numbers) is named cut, not printed whole in the plan's error."""

from __future__ import annotations

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conductor.errors import PlanError
from conductor.plans import parse_plan
from conductor.pool import parse_pool
from tests.conftest import cli, run_cli, write_pool


def _rows(r) -> list[dict]:
    assert r.returncode == 0, r.stdout + r.stderr
    return [orjson.loads(line) for line in r.stdout.splitlines()]


def _with(sample_queries, path, columns: dict) -> None:
    table = pq.read_table(sample_queries).slice(0, 3)
    for name, values in columns.items():
        table = table.append_column(name, pa.array(values))
    pq.write_table(table, path)


def test_a_column_named_as_a_results_column_in_other_case_is_carried_as_input_name(tmp_path, fresh_sim,
                                                                                    sample_queries):
    queries, data = tmp_path / "cased.parquet", tmp_path / "data"
    _with(sample_queries, queries, {"Status": ["approved", "rejected", "pending"], "COST_USD": ["a", "b", "c"]})
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    r = run_cli("run", queries, "--pool", pool, "--data-dir", data, "--run-id", "cased", "--quiet", "--no-cache")
    assert r.returncode == 0, r.stdout + r.stderr

    names = pq.read_schema(data / "runs" / "cased" / "results.parquet").names
    assert "input_Status" in names and "input_COST_USD" in names, names
    assert "Status" not in names and "COST_USD" not in names, names
    rows = _rows(cli("sql", "SELECT input_Status, input_COST_USD, status FROM results ORDER BY query_index",
                     "--data-dir", data, "--format", "json"))
    assert [(x["input_Status"], x["input_COST_USD"]) for x in rows] == [("approved", "a"), ("rejected", "b"),
                                                                       ("pending", "c")]
    assert {x["status"] for x in rows} <= {"ok", "failed", "invalid_plan"}  # conductor's own, not the user's
    described = _rows(cli("sql", "SELECT column_name FROM (DESCRIBE results)", "--data-dir", data, "--format", "json"))
    assert not [x for x in described if x["column_name"].endswith("_1")], described  # no name DuckDB made up


@pytest.mark.parametrize("columns, named", [
    ({"note": ["a", "b", "c"], "Note": ["x", "y", "z"]}, ["'note'", "'Note'"]),
    ({"Status": ["a", "b", "c"], "input_status": ["x", "y", "z"]}, ["'Status' (as 'input_Status')", "'input_status'"]),
])
def test_two_carried_columns_that_differ_only_in_case_are_refused_naming_both(tmp_path, fresh_sim, sample_queries,
                                                                              columns, named):
    queries, data = tmp_path / "twins.parquet", tmp_path / "data"
    _with(sample_queries, queries, columns)
    r = cli("run", queries, "--pool", write_pool(tmp_path / "pool.yaml", fresh_sim.url), "--data-dir", data)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"query set {queries}: columns {named[0]} and {named[1]} would be carried" in r.stderr, r.stderr
    assert "differ only in case" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (data / "runs").exists() and fresh_sim.log()["total"] == 0  # nothing written, nothing sent


POOL = parse_pool({"workers": [{"id": "small", "model": "openai/small"}, {"id": "big", "model": "openai/big"}]})
LONG = "9" * 4000  # under Python's 4,300-digit limit: read as a number, not as text


@pytest.mark.parametrize("text, start", [
    ('{"steps": [{"worker": %s, "instruction": "a"}]}' % LONG, "step 0: worker number 9999"),
    ("model_id = ['small', -%s]\nsubtasks = ['a', 'b']\naccess_list = [[], []]" % LONG, "step 1: worker number -999"),
    ('{"steps": [{"worker": "small", "instruction": "a"}, {"worker": "big", "instruction": "b", "access": [%s]}]}'
     % LONG, "step 1: access entry 9999"),
    ("model_id = ['small', 'big']\nsubtasks = ['a', 'b']\naccess_list = [[], [%s,]]" % LONG,
     "step 1: access entry 9999"),
    ('{"steps": [{"worker": "small", "instruction": "a"}, {"worker": "big", "instruction": "b", "access": -%s}]}'
     % LONG, "step 1: access entry -999"),
    ('{"steps": [{"worker": "small", "instruction": "a"}, {"worker": "big", "instruction": "b"}, '
     '{"worker": "big", "instruction": "c", "when": {"disagree": [0, %s]}}]}' % LONG,
     "step 2: condition disagree reads step 9999"),
])
def test_a_number_of_thousands_of_digits_is_cut_in_the_plans_error(text, start):
    with pytest.raises(PlanError) as e:
        parse_plan(text, POOL)
    message = str(e.value)
    assert message.startswith(start), message[:300]
    assert "(4,00" in message and len(message) < 200, message[:300]  # the length is told, the digits are not
