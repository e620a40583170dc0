"""Replies become typed records; fields are scored against references as the job says."""

from __future__ import annotations

from datetime import date

import pyarrow as pa
import pytest

from conductor.fields import Field, object_schema
from conductor.records import RecordChecker, parse_reply, repair_messages, typed_columns, with_schema_block
from conductor.enrich.score import reference_value, score_field, tatqa

FIELDS = (
    Field("answer", "string", required=True),
    Field("scale", "enum", values=("", "thousand", "million")),
    Field("amount", "number"),
    Field("n", "integer"),
    Field("ok", "boolean"),
    Field("period", "date"),
    Field("tags", "list"),
    Field("item", "object", fields=(Field("name", "string"), Field("value", "number"))),
)


def test_fenced_json_parses_and_prose_around_it_too():
    assert parse_reply('```json\n{"a": 1}\n```') == ({"a": 1}, None)
    assert parse_reply('Here it is: {"a": 1} hope it helps') == ({"a": 1}, None)
    obj, err = parse_reply('{"a": 1')
    assert obj is None and "not valid JSON" in err
    assert parse_reply("[1, 2]")[1] == "expected a JSON object, got list"
    # orjson keeps the last of a repeated key: a valid record holding a guess between two answers
    assert parse_reply('{"revenue": 1, "revenue": 2}') == \
        (None, "key 'revenue' is given twice in one object (which value is meant is unclear)")
    assert parse_reply('{"a": {"b": 1, "b": 1}}')[1].startswith("key 'b' is given twice")
    assert parse_reply('{"a": {"b": 1}, "c": {"b": 2}}') == ({"a": {"b": 1}, "c": {"b": 2}}, None)


def test_validation_names_the_field():
    checker = RecordChecker(object_schema(FIELDS, strict=False))
    rec, err = checker.check('{"answer": "x", "scale": "million", "period": "2019-12-31"}')
    assert err is None and rec["scale"] == "million"
    assert checker.check('{"scale": "million"}')[1] == "(record): 'answer' is a required property"
    assert checker.check('{"answer": "x", "scale": "lots"}')[1].startswith("scale: 'lots' is not one of")
    assert checker.check('{"answer": "x", "period": "31/12/2019"}')[1].startswith("period: '31/12/2019' is not a 'date'")
    assert checker.check('{"answer": "x", "n": 1.5}')[1].startswith("n: 1.5 is not of type 'integer'")
    # An integer column holds int64: 1e30 is a bad reply (repaired once), not a crash after paying.
    assert checker.check('{"answer": "x", "n": 1e30}')[1].startswith("n: 1e+30 is greater than the maximum")
    rec, err = checker.check('{"answer": "x", "n": 9223372036854775807}')
    assert err is None and typed_columns(FIELDS, [rec])["n"].to_pylist() == [2 ** 63 - 1]
    assert "Additional properties" in checker.check('{"answer": "x", "extra": 1}')[1]


def test_strict_wire_schema_lists_every_field_and_allows_null_for_optional():
    s = object_schema(FIELDS, strict=True)
    assert s["required"] == [f.name for f in FIELDS] and s["additionalProperties"] is False
    assert s["properties"]["amount"]["type"] == ["number", "null"]
    assert s["properties"]["answer"]["type"] == "string"
    assert s["properties"]["scale"]["enum"] == ["", "thousand", "million", None]


def test_records_typed_into_arrow():
    recs = [{"answer": "x", "scale": "", "amount": 3, "n": 2, "ok": True, "period": "2019-12-31",
             "tags": ["a", "b"], "item": {"name": "rev", "value": 1}}, None, {"answer": "y"}]
    cols = typed_columns(FIELDS, recs)
    assert cols["amount"].type == pa.float64() and cols["amount"].to_pylist() == [3.0, None, None]
    assert cols["n"].type == pa.int64()
    assert cols["ok"].type == pa.bool_()
    assert cols["period"].type == pa.date32() and cols["period"][0].as_py() == date(2019, 12, 31)
    assert cols["tags"].type == pa.list_(pa.string()) and cols["tags"][0].as_py() == ["a", "b"]
    assert cols["item"].type == pa.struct([("name", pa.string()), ("value", pa.float64())])
    assert cols["item"][0].as_py() == {"name": "rev", "value": 1.0}
    assert cols["scale"].type == pa.string()


def test_schema_block_and_repair_messages():
    schema = object_schema(FIELDS[:1], strict=True)
    msgs = with_schema_block([{"role": "user", "content": "Q"}], schema)
    assert msgs[0]["content"].startswith("Q\n\nReply with only a JSON object that matches this JSON Schema:\n```json\n")
    rep = repair_messages(msgs, "{bad", "not valid JSON", schema)
    assert [m["role"] for m in rep] == ["user", "assistant", "user"]
    assert rep[2]["content"].startswith("Your reply was not a valid record: not valid JSON")
    assert "Reply with only a JSON object that matches this JSON Schema:" in rep[2]["content"]


@pytest.mark.parametrize("kind,pred,gold,expected", [
    ("exact", "The Apple, Inc.", "apple inc", 1.0),
    ("exact", "pear", "apple", 0.0),
    ("numeric", 101, 100, 0.0),
    ("f1", "net sales rose", "net sales", 0.8),
    ("set", ["b", "A"], ["a", "b"], 1.0),
    ("set", ["a"], ["a", "b"], 0.0),
])
def test_scorers(kind, pred, gold, expected):
    assert score_field(kind, pred, gold)["score"] == pytest.approx(expected)


def test_numeric_tolerance_and_missing_values():
    assert score_field("numeric", "1,010", 1000, rel_tol=0.01)["score"] == 1.0
    assert score_field("numeric", None, 1000) == {"score": 0.0}
    assert score_field("numeric", 3, None) is None


def test_tatqa_number_counts_only_with_the_right_scale():
    assert tatqa(["1,496.5"], ["$1,496.5"], "million", "million", "span") == (1.0, 1.0)
    assert tatqa(["1496.5"], ["$1,496.5"], "thousand", "million", "span") == (0.0, 0.0)
    assert tatqa(["-0.25"], ["-0.25"], "percent", "percent", "arithmetic") == (1.0, 1.0)
    # percent is a scale of 0.01, as TAT-QA's scale_to_num: 12 is not 12 percent, "12%" is
    assert tatqa(["12"], ["12"], "", "percent", "arithmetic") == (0.0, 0.0)
    assert tatqa(["12%"], ["12"], "", "percent", "arithmetic") == (1.0, 1.0)
    assert tatqa(["0.2342"], ["23.42"], "", "percent", "arithmetic") == (1.0, 1.0)  # a share for a percent
    assert tatqa(["2019"], ["2019"], "percent", "", "span") == (0.0, 0.0)
    # spans: exact match after normalization, token F1 for partial answers
    em, f1 = tatqa(["fixed-price type"], ["fixed-price type contracts"], "", "", "span")
    assert em == 0.0 and 0 < f1 < 1
    # multi-span: order does not matter
    assert tatqa(["b thing", "a thing"], ["a thing", "b thing"], "", "", "multi-span")[0] == 1.0
    # arithmetic: F1 equals exact match
    assert tatqa(["12.6"], ["12.5"], "", "", "arithmetic") == (0.0, 0.0)


def test_reference_values_take_the_field_type():
    assert reference_value(Field("a", "list"), '["x", "y"]') == ["x", "y"]
    assert reference_value(Field("a", "list"), "-0.25") == ["-0.25"]
    assert reference_value(Field("a", "number"), "1,200") == 1200.0
    assert reference_value(Field("a", "string"), ["x", "y"]) == "x, y"
    assert reference_value(Field("a", "enum", values=("", "million")), "") == ""


def test_vote_over_records_is_field_wise_and_extract_returns_the_one_record():
    import orjson

    from conductor.execute.structured import combine_records, records_agree

    outs = ['{"a": 1, "b": "x"}', '```json\n{"a": 2, "b": "y"}\n```', '{"a": 2, "b": "x"}', "not a record", None]
    assert orjson.loads(combine_records("vote", outs)) == {"a": 2, "b": "x"}
    # a tie goes to the earliest step's value
    assert orjson.loads(combine_records("vote", ['{"a": 1}', '{"a": 2}'])) == {"a": 1}
    assert orjson.loads(combine_records("extract", ['{"a": 1}', "junk"])) == {"a": 1}
    with pytest.raises(ValueError, match="holds a record"):
        combine_records("vote", ["junk", None])
    assert records_agree('{"a": 1, "b": [1, 2]}', '```json\n{"b": [1, 2], "a": 1}\n```')
    assert not records_agree('{"a": 1}', '{"a": 2}') and not records_agree('{"a": 1}', "junk")


def test_response_format_where_the_provider_takes_it_else_the_prompt_block():
    from conductor.execute.structured import RecordSpec
    from conductor.pool import Worker

    schema = object_schema(FIELDS[:2], strict=True)
    spec = RecordSpec("job", schema, RecordChecker(schema))
    local = Worker("w", "p", model="openai/anything", api_base="http://127.0.0.1:8000/v1")
    assert spec.native(local)  # an OpenAI-compatible server (vLLM, the sim)
    assert spec.native(Worker("w", "p", model="openai/gpt-4o-mini"))  # litellm says it supports a schema
    assert not spec.native(Worker("w", "p", model="ollama/llama2"))
    assert not RecordSpec("job", schema, RecordChecker(schema), "prompt").native(local)
    assert RecordSpec("job", schema, RecordChecker(schema), "response_format").native(Worker("w", "p", model="x/y"))
    rf = spec.response_format()
    assert rf == {"type": "json_schema", "json_schema": {"name": "job", "schema": schema, "strict": True}}
