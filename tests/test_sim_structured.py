"""The simulated pool answering structured (JSON record) requests, over real HTTP."""

from __future__ import annotations

import asyncio
import os
import re

import aiohttp
import jsonschema
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.pool import parse_pool
from conductor.sim.config import SimConfigError, served_models
from conductor.sim.process import start_sim
from conductor.sim.structured import PROMPT_MARKER, REPAIR_MARKER

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

POOL = {
    "providers": {"sim": {"rpm": 100000}},
    "workers": [
        {"id": "oracle", "provider": "sim", "model": "openai/sim-oracle", "simulate": {"skill": 1.0}},
        {"id": "liar", "provider": "sim", "model": "openai/sim-liar", "simulate": {"skill": 0.0}},
        {"id": "good", "provider": "sim", "model": "openai/sim-good",
         "simulate": {"skill": {"record": 0.7, "default": 0.2}}},
        {"id": "sloppy", "provider": "sim", "model": "openai/sim-sloppy",
         "simulate": {"skill": 1.0, "malformed_json": 0.25}},
    ],
}
SCALES = ["", "thousand", "million", "billion", "percent"]
N = 300

# What an enrichment job's schema looks like in strict mode: every field
# required, optional ones nullable; types, enum, date, list, nested object.
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["answer", "scale", "amount", "count", "restated", "period", "tags", "item", "note"],
    "properties": {
        "answer": {"type": "string", "description": "the answer"},
        "scale": {"type": "string", "enum": SCALES},
        "amount": {"type": ["number", "null"]},
        "count": {"type": "integer"},
        "restated": {"type": "boolean"},
        "period": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "item": {"$ref": "#/$defs/item"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "$defs": {"item": {"type": "object", "additionalProperties": False, "required": ["name", "value"],
                       "properties": {"name": {"type": "string"}, "value": {"type": "number"}}}},
}
REFERENCED = ("answer", "scale", "amount", "count", "restated", "period", "tags", "item")
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.FormatChecker())


def _rows() -> list[dict]:
    rows = []
    for i in range(N):
        ref = {"answer": f"revenue of segment {i}", "scale": SCALES[i % 5], "amount": round(1000 + i * 7.25, 2),
               "count": i % 17, "restated": i % 2 == 0, "period": f"{2015 + i % 9}-12-31",
               "tags": [f"tag{i % 4}", f"area{i % 3}"], "item": {"name": f"Line {i}", "value": i * 1.5},
               "note": None}
        doc = (f"Report {i}. The company's revenue of segment {i} rose to {1000 + i * 7.25:,.2f} in fiscal "
               f"{2015 + i % 9}; operating costs fell to {500 + i} while headcount reached {40 + i}. "
               "Management expects growth in retail and wholesale channels next year.")
        rows.append({"query_id": f"r{i}", "task": "record", "reference": orjson.dumps(ref).decode(),
                     "prompt": doc, "_ref": ref})
    # a row with no reference at all: values are still plausible and valid
    rows.append({"query_id": "noref", "task": "record", "reference": None, "_ref": None,
                 "prompt": "Report X. Sales were 12,500 in 2021 and 13,100 in 2022 across nine stores."})
    return rows


ROWS = _rows()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("simrec")
    (d / "pool.yaml").write_text(yaml.safe_dump(POOL))
    cols = {c: [r[c] for r in ROWS] for c in ("query_id", "prompt", "task", "reference")}
    pq.write_table(pa.table(cols), d / "queries.parquet")
    return d


@pytest.fixture(scope="module")
def sim(files):
    with start_sim(files / "pool.yaml", files / "queries.parquet", latency_ms=0) as handle:
        yield handle


@pytest.fixture(autouse=True)
def _fresh(request):
    if "sim" in request.fixturenames:
        handle = request.getfixturevalue("sim")
        handle.clear_faults()
        handle.reset()


def schema_block(schema: dict) -> str:
    return f"{PROMPT_MARKER}\n```json\n{orjson.dumps(schema, option=orjson.OPT_INDENT_2).decode()}\n```"


def with_format(model: str, prompt: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "job", "schema": SCHEMA, "strict": True}}, **extra}


def in_prompt(model: str, prompt: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt + "\n\n" + schema_block(SCHEMA)}]}


def ask_all(sim, bodies: list[dict]) -> list[tuple[int, dict]]:
    async def go():
        sem = asyncio.Semaphore(32)
        async with aiohttp.ClientSession() as s:
            async def one(b):
                async with sem, s.post(sim.url + "/chat/completions", data=orjson.dumps(b),
                                       headers={"Content-Type": "application/json"}) as r:
                    return r.status, orjson.loads(await r.read())
            return await asyncio.gather(*(one(b) for b in bodies))
    return asyncio.run(go())


def content(resp: dict) -> str:
    return resp["choices"][0]["message"]["content"]


def records(sim, bodies) -> list[dict]:
    out = []
    for status, resp in ask_all(sim, bodies):
        assert status == 200, resp
        out.append(orjson.loads(content(resp)))
    return out


# -- valid records --------------------------------------------------------------

@pytest.mark.parametrize("build", [with_format, in_prompt], ids=["response_format", "prompt_block"])
def test_every_reply_is_a_schema_valid_record(sim, build):
    bodies = [build(m, r["prompt"]) for m in ("sim-oracle", "sim-liar", "sim-good") for r in ROWS]
    for rec in records(sim, bodies):
        errors = [e.message for e in VALIDATOR.iter_errors(rec)]
        assert not errors, (rec, errors)


def test_oracle_gives_the_reference_and_liar_plausible_wrong_values(sim):
    rows = [r for r in ROWS if r["_ref"]]
    right = records(sim, [with_format("sim-oracle", r["prompt"]) for r in rows])
    wrong = records(sim, [in_prompt("sim-liar", r["prompt"]) for r in rows])
    for r, good, bad in zip(rows, right, wrong):
        ref = r["_ref"]
        for f in REFERENCED:
            assert good[f] == ref[f], (f, good[f], ref[f])
            assert bad[f] != ref[f], (f, bad[f])
        assert bad["scale"] in SCALES
        assert isinstance(bad["count"], int) and isinstance(bad["restated"], bool)
        assert isinstance(bad["amount"], float) and bad["amount"] > 0
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", bad["period"])
        # a wrong string is another string of the same kind: digits changed, or words of the document
        assert bad["answer"] != ref["answer"] and (
            re.sub(r"\d", "", bad["answer"]) == re.sub(r"\d", "", ref["answer"]) or bad["answer"] in r["prompt"])
        assert set(bad["item"]) == {"name", "value"}


def test_field_accuracy_follows_skill(sim):
    rows = [r for r in ROWS if r["_ref"]]
    got = records(sim, [with_format("sim-good", r["prompt"]) for r in rows])
    hits = [got_rec[f] == r["_ref"][f] for r, got_rec in zip(rows, got) for f in REFERENCED]
    rate = sum(hits) / len(hits)
    assert abs(rate - 0.7) < 0.05, rate
    # fields are drawn independently: some records are partly right
    partly = sum(0 < sum(g[f] == r["_ref"][f] for f in REFERENCED) < len(REFERENCED) for r, g in zip(rows, got))
    assert partly > len(rows) // 2


def test_a_row_without_reference_gets_plausible_values_from_its_document(sim):
    row = ROWS[-1]
    recs = records(sim, [with_format("sim-good", row["prompt"], seed=s) for s in range(20)])
    assert all(not list(VALIDATOR.iter_errors(r)) for r in recs)
    assert any(r["answer"] in row["prompt"] for r in recs)
    assert any(r["amount"] in (12500.0, 13100.0, 2021.0, 2022.0) for r in recs)
    assert any(r["period"][:4] in ("2021", "2022") for r in recs)


def test_unknown_document_still_gets_a_valid_record(sim):
    rec = records(sim, [with_format("sim-oracle", "Something nobody asked about before, on page 7.")])[0]
    assert not list(VALIDATOR.iter_errors(rec))


def test_same_request_same_record_and_answers_are_labeled_simulated(sim):
    body = with_format("sim-good", ROWS[3]["prompt"], temperature=0.5)
    a, b = ask_all(sim, [body, body])
    assert content(a[1]) == content(b[1])
    assert a[1]["system_fingerprint"] == "conductor-sim"


def test_log_counts_answers_per_query_and_kind(sim):
    ask_all(sim, [with_format("sim-oracle", r["prompt"]) for r in ROWS[:10]]
            + [in_prompt("sim-oracle", ROWS[0]["prompt"])])
    log = sim.log()
    assert log["by_query"] == {**{r["query_id"]: 1 for r in ROWS[1:10]}, "r0": 2}
    assert log["by_kind"] == {"record": 11}


# -- malformed replies and repairs ------------------------------------------------

def classify(text: str) -> str:
    try:
        rec = orjson.loads(text)
    except orjson.JSONDecodeError:
        return "unparseable"
    return "invalid" if list(VALIDATOR.iter_errors(rec)) else "record"


def test_malformed_json_breaks_replies_both_ways(sim):
    sim.set_faults("*", malformed_json=1.0)
    rows = ROWS[:120]
    results = ask_all(sim, [with_format("sim-oracle", r["prompt"]) for r in rows])
    kinds = [classify(content(resp)) for _, resp in results]
    assert "record" not in kinds
    assert 30 < kinds.count("unparseable") < 90 and 30 < kinds.count("invalid") < 90
    log = sim.log()["by_kind"]
    assert log == {"unparseable": kinds.count("unparseable"), "invalid": kinds.count("invalid")}
    # per request: the same request breaks the same way
    again = ask_all(sim, [with_format("sim-oracle", r["prompt"]) for r in rows[:20]])
    assert [content(r) for _, r in again] == [content(r) for _, r in results[:20]]


def test_malformed_rate_from_the_pool_and_repairs(sim):
    """sim-sloppy breaks a quarter of its replies (pool setting); a repair call
    (the bad reply shown back with the error) is answered validly unless the
    fault strikes again."""
    rows = [r for r in ROWS if r["_ref"]]
    first = ask_all(sim, [in_prompt("sim-sloppy", r["prompt"]) for r in rows])
    bad = [(r, content(resp)) for r, (_, resp) in zip(rows, first) if classify(content(resp)) != "record"]
    assert 0.15 < len(bad) / len(rows) < 0.35
    repairs = []
    for r, text in bad:
        msgs = in_prompt("sim-sloppy", r["prompt"])["messages"] + [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"{REPAIR_MARKER} the reply is not valid JSON.\n\n{schema_block(SCHEMA)}"}]
        repairs.append({"model": "sim-sloppy", "messages": msgs})
    fixed = ask_all(sim, repairs)
    kinds = [classify(content(resp)) for _, resp in fixed]
    assert kinds.count("record") >= len(kinds) // 2
    log = sim.log()
    assert log["by_kind"]["repair"] == len(repairs)
    # the repair is about the same row: the oracle-skilled worker repeats the reference
    for (r, _), kind, (_, resp) in zip(bad, kinds, fixed):
        if kind == "record":
            assert orjson.loads(content(resp))["answer"] == r["_ref"]["answer"]
    # with no fault, every repair is valid
    sim.set_faults("sim-sloppy", malformed_json=0)
    assert all(classify(content(resp)) == "record" for _, resp in ask_all(sim, repairs))


# -- bad requests and configuration ------------------------------------------------

def post(sim, body):
    import httpx
    r = httpx.post(sim.url + "/chat/completions", json=body)
    return r.status_code, r.json()


def test_a_schema_that_cannot_be_read_is_a_400(sim):
    status, resp = post(sim, {"model": "sim-oracle", "messages": [
        {"role": "user", "content": f"Doc.\n{PROMPT_MARKER}\n```json\n{{\"type\": \"object\",\n```"}]})
    assert status == 400 and "does not parse" in resp["error"]["message"]
    status, resp = post(sim, {"model": "sim-oracle", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert status == 400 and resp["error"]["param"] == "response_format.json_schema.schema"


def test_plain_requests_are_answered_as_before(sim):
    status, resp = post(sim, {"model": "sim-oracle", "messages": [{"role": "user", "content": ROWS[0]["prompt"]}]})
    assert status == 200 and content(resp).splitlines()[-1].startswith("Answer: ")


@pytest.mark.parametrize("value, ok", [(0.2, True), (1.5, False), ("often", False)])
def test_malformed_json_in_the_pool(value, ok):
    pool = parse_pool({"workers": [{"id": "w", "model": "openai/m", "simulate": {"malformed_json": value}}]})
    if ok:
        assert served_models(pool)["m"].faults["malformed_json"] == value
    else:
        with pytest.raises(SimConfigError, match="worker w: simulate.malformed_json: must be a"):
            served_models(pool)


def test_litellm_passes_the_schema_and_gets_a_record(sim):
    import litellm

    r = ROWS[5]
    resp = litellm.completion(model="openai/sim-oracle", api_base=sim.url, api_key="x",
                              messages=[{"role": "user", "content": r["prompt"]}], num_retries=0,
                              response_format={"type": "json_schema",
                                               "json_schema": {"name": "job", "schema": SCHEMA, "strict": True}})
    rec = orjson.loads(resp.choices[0].message.content)
    assert rec["answer"] == r["_ref"]["answer"] and not list(VALIDATOR.iter_errors(rec))


def test_malformed_json_flag_at_start(files):
    """`conductor sim --malformed-json 1` (start_sim's keyword) breaks every record; plain answers are untouched."""
    with start_sim(files / "pool.yaml", files / "queries.parquet", latency_ms=0, malformed_json=1.0) as other:
        kinds = [classify(content(resp)) for _, resp in ask_all(other, [with_format("sim-oracle", r["prompt"])
                                                                         for r in ROWS[:20]])]
        assert "record" not in kinds
        assert other.faults()["effective"]["sim-oracle"]["malformed_json"] == 1.0
        status, resp = post(other, {"model": "sim-oracle",
                                    "messages": [{"role": "user", "content": ROWS[0]["prompt"]}]})
        assert status == 200 and content(resp).splitlines()[-1].startswith("Answer: ")
