"""A structured request's JSON Schema (`response_format`) and a worker's `tools` are prompt the
provider bills: every token bound counts them. Left out, an honest server's usage for a typed-field
job was clamped to the messages' bytes ("reported usage clamped: prompt_tokens 100 > 79"), the
recorded cost came out several times too low, and each call's reserved worst case undershot what
it cost, so a run spent past its budget_usd.

`conductor job run` as a user starts it, against a small OpenAI-compatible server on 127.0.0.1
(port from the OS) that bills as a tokenizer would: a token per 3 bytes of every message and of
the request's response_format and tools, as they arrived."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import cli

PRICE_IN, PRICE_OUT = 1.0e-6, 2.0e-6  # per token: the pool's 1.0 and 2.0 per million
RECORD = {"vendor": "Acme Corporation", "amount": 1250.5, "currency": "EUR", "units": 12, "paid": True,
          "due": "2024-03-01", "tags": ["parts", "q1"], "category": "hardware"}
TEXT_ANSWER = "Acme Corporation sold 12 units of part P7 for EUR 1,250.50, due 2024-03-01."
TOOLS = [{"type": "function", "function": {
    "name": "lookup_vendor", "description": "Look a vendor up in the company's register by its legal name, "
    "returning its id, country, payment terms and the currency it invoices in.",
    "parameters": {"type": "object", "properties": {
        "name": {"type": "string", "description": "the vendor's legal name, as printed on the invoice"},
        "country": {"type": "string", "description": "an ISO 3166 country code, when the invoice shows one"}},
        "required": ["name"]}}}]


class Billing:
    """The server's side: what each request was billed, counted from the bytes it received."""

    def __init__(self, content: str):
        self.content, self.billed, self.lock = content, [], threading.Lock()

    def usage(self, body: dict) -> dict:
        size = sum(len((m.get("content") or "").encode()) for m in body["messages"])
        for key in ("response_format", "tools"):
            if body.get(key) is not None:
                size += len(json.dumps(body[key], separators=(",", ":")).encode())
        prompt, completion = size // 3, max(1, len(self.content.encode()) // 4)
        with self.lock:
            self.billed.append({"prompt": prompt, "completion": completion, "messages": body["messages"],
                                "response_format": body.get("response_format"), "tools": body.get("tools")})
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def cost(self) -> float:
        return sum(b["prompt"] * PRICE_IN + b["completion"] * PRICE_OUT for b in self.billed)


@pytest.fixture
def server():
    servers = []

    def start(content: str) -> tuple[str, Billing]:
        billing = Billing(content)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                answer = json.dumps({
                    "id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": billing.content}}],
                    "usage": billing.usage(body)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}/v1", billing

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def write_job(folder: Path, url: str, rows: int, fields: bool = True, budget_usd: float | None = None,
              max_tokens: int = 256, params: dict | None = None) -> Path:
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "text": [f"Invoice {i}: P{i}." for i in range(rows)]}),
                   folder / "input.parquet")
    (folder / "pool.yaml").write_text(yaml.safe_dump({
        "providers": {"local": {"max_concurrency": 1, "timeout_s": 10}},
        "workers": [{"id": "mid", "model": "openai/mid", "provider": "local", "api_base": url,
                     "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
                     "params": {"temperature": 0, "max_tokens": max_tokens, **(params or {})}}]}, sort_keys=False))
    doc = {"name": "invoices", "input": {"path": "input.parquet", "id": "id"}, "prompt": "Extract: {{ text }}",
           "pool": "pool.yaml", "mode": "direct", "worker": "mid"}
    if fields:
        doc["fields"] = {
            "vendor": {"type": "string", "description": "the seller's legal name as printed", "required": True},
            "amount": {"type": "number", "description": "the invoice total, taxes included"},
            "currency": {"type": "enum", "values": ["EUR", "USD", "GBP", "CHF"]},
            "units": {"type": "integer", "description": "how many units were sold"},
            "paid": {"type": "boolean", "description": "whether the invoice says it was paid"},
            "due": {"type": "date", "description": "the payment's due date"},
            "tags": {"type": "list", "items": "string", "description": "short labels for the goods"},
            "category": {"type": "string", "description": "the kind of goods: hardware, software or services"}}
    if budget_usd is not None:
        doc["budget_usd"] = budget_usd
    (folder / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder / "job.yaml"


def traces(data: Path) -> list[dict]:
    (run,) = (data / "runs").iterdir()
    return pq.read_table(run / "traces.parquet").to_pylist()


@pytest.mark.parametrize("kind", ["response_format", "tools"])
def test_honest_usage_of_a_request_with_a_schema_or_tools_is_recorded_as_reported(tmp_path, server, kind):
    structured = kind == "response_format"
    url, billing = server(json.dumps(RECORD) if structured else TEXT_ANSWER)
    job = write_job(tmp_path, url, rows=4, fields=structured, params=None if structured else {"tools": TOOLS})
    r = cli("job", "run", job, "--data-dir", tmp_path / "data")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(billing.billed) == 4 and all(b[kind] for b in billing.billed)  # the schema or tools went
    # what the provider bills as prompt is mostly the schema or tools, not the short messages
    assert all(b["prompt"] * 3 > 2 * sum(len(m["content"]) for m in b["messages"]) for b in billing.billed)
    rows = sorted(traces(tmp_path / "data"), key=lambda t: t["query_id"])
    assert [t["status"] for t in rows] == ["ok"] * 4
    assert [t["error"] for t in rows] == [None] * 4, rows[0]["error"]  # was "reported usage clamped: ..."
    assert not any(t["usage_estimated"] for t in rows)
    assert sorted(t["prompt_tokens"] for t in rows) == sorted(b["prompt"] for b in billing.billed)
    assert sorted(t["completion_tokens"] for t in rows) == sorted(b["completion"] for b in billing.billed)
    assert sum(t["cost_usd"] for t in rows) == pytest.approx(billing.cost(), rel=1e-9)


def test_a_budget_holds_against_what_a_structured_request_is_billed(tmp_path, server):
    """Each call reserves its worst case, schema included, before it is sent: a budget that fits
    one call's worst case and a bit is never overrun, whatever the server bills within the bounds.
    The schema left out, every call reserved less than it cost and all 8 rows were sent."""
    url, billing = server(json.dumps(RECORD))
    probe = write_job(tmp_path, url, rows=1, max_tokens=64)
    assert cli("job", "run", probe, "--data-dir", tmp_path / "probe").returncode == 0
    one = billing.cost()  # what one call is billed
    billing.billed.clear()
    budget = 3.5 * one
    job = write_job(tmp_path, url, rows=8, budget_usd=round(budget, 9), max_tokens=64)
    r = cli("job", "run", job, "--data-dir", tmp_path / "data")
    assert r.returncode != 0, r.stdout + r.stderr  # stopped by its budget: rerun with more to finish
    assert "budget" in r.stdout + r.stderr
    assert 1 <= len(billing.billed) < 8
    assert billing.cost() <= round(budget, 9) + 1e-12  # the provider billed no more than budget_usd
    rows = [t for t in traces(tmp_path / "data") if t["status"] == "ok"]
    assert len(rows) == len(billing.billed) and not any(t["usage_estimated"] for t in rows)
    assert sum(t["cost_usd"] for t in rows) == pytest.approx(billing.cost(), rel=1e-9)
