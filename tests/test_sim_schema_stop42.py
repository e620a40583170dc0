"""Audit 75 F4: the simulated pool billed only the messages' text as prompt tokens, not the JSON
Schema of `response_format` (nor tools), which a provider such as OpenAI bills as prompt: a
structured job's cost against the sim understated a provider's at the same prices. Counted at the
simulated server over HTTP, and a budget still holds against what it now bills."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from conductor.tokens import max_prompt_tokens
from tests.conftest import PRICE_IN, PRICE_OUT, run_cli, worker

MESSAGES = [{"role": "user", "content": "Invoice 7: 107 units of part P7. Which part, how many units?"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["part", "units", "note"],
          "properties": {"part": {"type": "string", "description": "the part number as written on the invoice"},
                         "units": {"type": "integer", "description": "how many units the invoice lists"},
                         "note": {"type": ["string", "null"], "description": "anything unusual, else null"}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "invoice", "schema": SCHEMA, "strict": True}}
TOOLS = [{"type": "function", "function": {"name": "lookup_part", "description": "Looks a part up in the catalog.",
                                           "parameters": SCHEMA}}]


def chat(url: str, **extra) -> dict:
    body = orjson.dumps({"model": "fast", "messages": MESSAGES, "temperature": 0, **extra})
    req = urllib.request.Request(f"{url}/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_a_response_format_schema_is_billed_as_prompt_tokens_by_its_size(fresh_sim):
    plain = chat(fresh_sim.url)["usage"]["prompt_tokens"]
    billed_plain = fresh_sim.log()["billed_tokens"]["fast"][0]
    with_schema = chat(fresh_sim.url, response_format=RESPONSE_FORMAT)["usage"]["prompt_tokens"]
    billed_both = fresh_sim.log()["billed_tokens"]["fast"][0]
    size = len(orjson.dumps(RESPONSE_FORMAT))  # 412 bytes: about 103 tokens
    assert abs((with_schema - plain) - size / 4) <= 2, (plain, with_schema, size)
    assert billed_both - billed_plain == with_schema  # the server's bill, not only the reported usage
    # still within the bound budgets reserve for the request (conductor.tokens)
    assert with_schema <= max_prompt_tokens(MESSAGES, {"response_format": RESPONSE_FORMAT})
    # a response_format without a schema writes nothing into the prompt
    assert chat(fresh_sim.url, response_format={"type": "json_object"})["usage"]["prompt_tokens"] == plain
    assert chat(fresh_sim.url, response_format={"type": "text"})["usage"]["prompt_tokens"] == plain


def test_tools_are_billed_as_prompt_tokens_too(fresh_sim):
    plain = chat(fresh_sim.url)["usage"]["prompt_tokens"]
    with_tools = chat(fresh_sim.url, tools=TOOLS)["usage"]["prompt_tokens"]
    assert abs((with_tools - plain) - len(orjson.dumps(TOOLS)) / 4) <= 2, (plain, with_tools)


def test_a_budget_holds_against_the_schema_the_sim_now_bills(fresh_sim, tmp_path):
    """Short prompts under a schema several times their size, with descriptions in a script of a
    token a character, 32 calls at a time and a budget that stops the run: what the server billed
    stays within the budget, the run's cost is that bill, and each call's prompt counts the schema."""
    n = 60
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(n)],
                             "text": [f"Invoice {i}: {100 + i} units of part P{i}." for i in range(n)]}),
                   tmp_path / "input.parquet")
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump({
        "providers": {"sim": {"max_concurrency": 32, "timeout_s": 10}},
        "workers": [worker("fast", fresh_sim.url)]}, sort_keys=False))
    fields = {f"f{k}": {"type": "string", "description": f"第{k}項：請求書に書かれた部品番号と数量の説明"}
              for k in range(12)}
    budget = 0.012
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "docs", "input": {"path": "input.parquet", "id": "id"}, "prompt": "Note: {{ text }}",
        "fields": fields, "pool": "pool.yaml", "mode": "direct", "worker": "fast", "budget_usd": budget},
        sort_keys=False, allow_unicode=True))
    r = run_cli("job", "run", tmp_path / "job.yaml", "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 3, r.stdout + r.stderr  # stopped by the budget, some rows answered
    prompt, completion = fresh_sim.log()["billed_tokens"]["fast"]
    billed = prompt * PRICE_IN + completion * PRICE_OUT
    assert 0 < billed <= budget
    summary = json.loads(next((tmp_path / "data" / "runs").glob("docs-*/summary.json")).read_text())
    assert abs(summary["cost_usd"] - billed) < 1e-9
    traces = pq.read_table(next((tmp_path / "data" / "runs").glob("docs-*/traces.parquet"))).to_pylist()
    answered = [t for t in traces if t["prompt_tokens"]]
    assert answered and sum(t["prompt_tokens"] for t in answered) == prompt
    # each prompt is ~10 tokens of text; the schema's descriptions alone are 12 x 23 characters
    assert min(t["prompt_tokens"] for t in answered) > 12 * 23
