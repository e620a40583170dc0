"""review40 8: a number of thousands of digits in a Python three-list plan is named at its step,
as in the JSON form, not "not a valid list literal". A query set with a column name given twice is
refused naming the file and the column, before anything runs, not in pyarrow's words."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conductor.errors import InputError, PlanError
from conductor.plans import parse_plan
from conductor.pool import parse_pool
from conductor.queries import validate
from tests.conftest import cli, write_pool

POOL = parse_pool({"workers": [{"id": "small", "model": "openai/small"}, {"id": "big", "model": "openai/big"}]})
BIG = "9" * 5000


def refusal(text: str) -> str:
    with pytest.raises(PlanError) as e:
        parse_plan(text, POOL)
    return str(e.value)


def three_lists(models: str, access: str, conditions: str | None = None) -> str:
    text = f"model_id = {models}\nsubtasks = ['a', 'b', 'c']\naccess_list = {access}\n"
    return text + (f"conditions = {conditions}\n" if conditions else "")


def as_json(models: str, access: str, conditions: str | None = None) -> str:
    text = f'model_id = {models}\nsubtasks = ["a", "b", "c"]\naccess_list = {access}\n'
    return text + (f"conditions = {conditions}\n" if conditions else "")


# Each plan as Python lists (single quotes, None, a trailing comma, a spaced sign: not JSON), then as JSON.
@pytest.mark.parametrize("python, json, start", [
    (three_lists(f"[{BIG}, 'small', 'big']", "[[], [0], [1]]"),  # the review's plan
     as_json(f'[{BIG}, "small", "big"]', "[[], [0], [1]]"), "step 0: worker '9999"),
    (three_lists("['small', 'big', 'big']", f"[[], [- {BIG}], [1]]"),
     as_json('["small", "big", "big"]', f"[[], [-{BIG}], [1]]"), "step 1: access entry '-9999"),
    (three_lists("['small', 'big', 'big']", f"[[], [0], [\n    {BIG},\n]]"),
     as_json('["small", "big", "big"]', f"[[], [0], [\n    {BIG}\n]]"), "step 2: access entry '9999"),
    (three_lists("['small', 'big', 'big']", "[[], [], []]", f"[None, None, {{'disagree': [0, {BIG}]}}]"),
     as_json('["small", "big", "big"]', "[[], [], []]", f'[null, null, {{"disagree": [0, {BIG}]}}]'),
     "step 2: condition disagree: '9999"),
])
def test_thousands_of_digits_in_python_lists_are_named_at_their_step_as_in_json(python, json, start):
    message = refusal(python)
    assert message.startswith(start), message
    assert "(5,0" in message and len(message) < 200  # the length is told, the digits are not repeated
    assert "not a valid list literal" not in message and "set_int_max_str_digits" not in message
    assert refusal(json) == message  # the same plan written as JSON lists is refused in the same words


def _twice(names: list[str]) -> pa.Table:
    values = {"query_id": ["q1", "q2"], "prompt": ["What is 2+3?", "What is 7*6?"], "note": ["a", "b"]}
    return pa.Table.from_arrays([pa.array(values[n]) for n in names], names=names)


TWICE = [(["query_id", "prompt", "prompt"], "prompt"),
         (["query_id", "query_id", "prompt"], "query_id"),
         (["query_id", "prompt", "note", "note"], "note")]  # a column carried into results


@pytest.mark.parametrize("names, column", TWICE)
def test_a_query_set_with_a_column_name_given_twice_is_refused_before_anything_runs(tmp_path, fresh_sim, names,
                                                                                    column):
    path = tmp_path / "q.parquet"
    pq.write_table(_twice(names), path)
    data = tmp_path / "data"
    r = cli("run", path, "--pool", write_pool(tmp_path / "pool.yaml", fresh_sim.url), "--data-dir", data)
    assert r.returncode == 2, r.stderr
    assert f"query set {path}: column name(s) given more than once: '{column}' (2 times)" in r.stderr, r.stderr
    assert "Multiple matches" not in r.stderr and "FieldRef" not in r.stderr and "Traceback" not in r.stderr
    assert not (data / "runs").exists() and fresh_sim.log()["total"] == 0


@pytest.mark.parametrize("names, column", TWICE)
def test_a_table_with_a_column_name_given_twice_is_refused_naming_it(names, column):
    """The check also holds for a table built in memory (`conductor replay queries` validates before writing)."""
    with pytest.raises(InputError, match=rf"^query set built: column name\(s\) given more than once: '{column}'"):
        validate(_twice(names), "built")
