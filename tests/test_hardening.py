"""Faults real providers and disks produce (issue 12): malformed answers, storage
errors, shared requests that fail, endpoints that go away. Real HTTP to local
servers on 127.0.0.1: the simulated pool, or a tiny fault server for shapes the
sim cannot produce."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow.parquet as pq
import pytest

from conductor.runner import RunConfig, run_all
from tests.conftest import run_cli, worker, write_pool
from tests.test_executor import FixedPlanner, solve


def _ok(model: str, content="Answer: 4", usage=None) -> dict:
    return {"id": "x", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": usage or {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}


# What the fault server answers, by the model a request names (after "openai/").
SHAPES = {
    "good": lambda m: (200, _ok(m)),
    "nochoices": lambda m: (200, {**_ok(m), "choices": []}),
    "nomessage": lambda m: (200, {**_ok(m), "choices": [{"index": 0, "finish_reason": "stop"}]}),
    "listcontent": lambda m: (200, _ok(m, content=[{"type": "text", "text": "hi"}])),
    "notjson": lambda m: (200, "this is not json"),
    "nullchoices": lambda m: (200, {**_ok(m), "choices": None}),
}


class FaultServer:
    """An OpenAI-compatible endpoint that answers each model with a fixed (status, body)."""

    def __init__(self, shapes=SHAPES):
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in shapes]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                outer.requests.append(body)
                model = body.get("model", "")
                status, doc = shapes.get(model, lambda m: (404, {"error": {"message": "no such model"}}))(model)
                self._send(status, doc)

            def _send(self, status, doc):
                data = doc.encode() if isinstance(doc, str) else json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fault_server():
    with FaultServer() as s:
        yield s


def _run(tmp_path, pool, queries, planner, **kw):
    cfg = RunConfig(queries=queries, pool=pool, data_dir=tmp_path / "data", progress=False, **kw)
    summary = run_all(cfg, planner=planner)
    out = tmp_path / "data" / "runs" / summary["run_id"]
    return summary, pq.read_table(out / "traces.parquet").to_pylist(), pq.read_table(out / "results.parquet").to_pylist()


def _queries(tmp_path, sample_queries, n):
    path = tmp_path / f"q{n}.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, n), path)
    return path


# ---- 1. malformed answers fail their plan, never the batch --------------------

def test_malformed_200_answers_fail_their_plan_not_the_batch(tmp_path, fault_server, sample_queries):
    bad = [s for s in SHAPES if s != "good"]
    workers = [worker(name, fault_server.url) for name in SHAPES]
    for w in workers:
        w["model"] = f"openai/{w['id']}"
    pool = write_pool(tmp_path / "pool.yaml", fault_server.url, workers=workers)
    names = list(SHAPES)
    planner = FixedPlanner(lambda q: solve(names[q.index % len(names)])(q))
    queries = _queries(tmp_path, sample_queries, 2 * len(names))
    summary, traces, results = _run(tmp_path, pool, queries, planner, cache=False)
    by_worker = {}
    for t in traces:
        by_worker.setdefault(t["worker"], []).append(t)
    assert {t["status"] for t in by_worker["good"]} == {"ok"}
    for name in bad:
        rows = by_worker[name]
        assert {t["status"] for t in rows} == {"error"}, name
        assert all(t["failure"] == "malformed" and f"worker {name}" in t["error"] for t in rows), rows
    assert summary["statuses"] == {"ok": 2, "error": 2 * len(bad)}
