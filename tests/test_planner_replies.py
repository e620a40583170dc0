"""The LLM planner against replies a real endpoint can send: a malformed reply or a
refused request fails that query's plan, not the batch; a bad key or model stops
planning at once; a plan the run cannot store is an invalid plan, not a crash.

The planner is a small HTTP server here that answers each question as the test
says; the workers are the simulated server's."""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pyarrow.parquet as pq
import pytest

from conductor.errors import ConductorError
from conductor.runner import RunConfig, run_all
from tests import plannersim
from tests.plannersim import psim, queries, sim  # noqa: F401  (shared fixtures)

# slow: the LLM planner over HTTP
pytestmark = pytest.mark.slow


def completion(content, finish_reason="stop") -> bytes:
    return orjson.dumps({"id": "x", "object": "chat.completion", "model": "fakeplanner",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                      "finish_reason": finish_reason}],
                         "usage": {"prompt_tokens": 10, "completion_tokens": 5}})


def plan(question: str, worker: str = "fast") -> str:
    return orjson.dumps({"steps": [{"worker": worker, "instruction": question, "access": []}]}).decode()


class Planner:
    """Answers the question at position i of the query set with replies[i] (status, body);
    any other question with a valid one-step plan."""

    def __init__(self, questions: list[str]):
        self.questions = questions
        self.replies: dict[int, tuple[int, bytes]] = {}
        self.asked: dict[int, int] = {}  # question -> requests for it
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = orjson.loads(self.rfile.read(int(self.headers["Content-Length"])))
                user = body["messages"][-1]["content"]
                i = next(i for i, q in enumerate(owner.questions) if q in user)
                owner.asked[i] = owner.asked.get(i, 0) + 1
                status, reply = owner.replies.get(i, (200, completion(plan(owner.questions[i]))))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def planner(queries):
    p = Planner(pq.read_table(queries).column("prompt").to_pylist())
    yield p
    p.close()


def run(tmp_path, sim, planner, queries, name="data", run_id=None, retry_failed=False):
    """Plan with the fake planner (free mode: no response_format) and run the plans on the sim."""
    pool = plannersim.pool_file(
        tmp_path / f"{name}.yaml", sim.url,
        planner=plannersim.planner_worker(planner.url, model="fakeplanner", provider="fp"),
        providers={"sim": {"max_concurrency": 16, "timeout_s": 10}, "fp": {"max_attempts": 1, "timeout_s": 10}})
    cfg = RunConfig(queries=queries, pool=pool, data_dir=tmp_path / name, run_id=run_id, progress=False,
                    planner="llm",
                    planner_options={"worker": "conductor", "structured": "off"}, cache=False,
                    retry_failed=retry_failed)
    summary = run_all(cfg)
    return summary, pq.read_table(tmp_path / name / "runs" / summary["run_id"] / "plans.parquet").to_pylist()


def test_a_malformed_reply_or_refused_request_fails_its_plan_and_the_batch_runs(sim, tmp_path, queries, planner):
    q = planner.questions
    two_plans = plan(q[5], "nobody") + "\n" + plan(q[5])  # a draft, then the plan
    planner.replies = {
        0: (200, completion(None, "length")),  # cut at max_tokens before any text
        1: (200, b"<html>oops</html>"),
        2: (200, b'{"id": "x", "object": "chat.completion", "choices": []}'),
        3: (400, b'{"error": {"message": "prompt too long", "type": "invalid_request_error"}}'),
        4: (200, completion('{"steps": [{"worker": "fast", "instruction": "' + q[4] + ' \\ud800", "access": []}]}')),
        5: (200, completion(two_plans)),
    }
    summary, plans = run(tmp_path, sim, planner, queries)
    by_query = {p["query_index"]: p for p in plans}
    errors = {i: by_query[i]["error"] for i in range(5)}
    assert not any(by_query[i]["valid"] for i in range(5))
    assert "planning call failed" in errors[0] and "no text content (length)" in errors[0]
    assert "malformed response: not JSON" in errors[1]
    assert "malformed response: no choices" in errors[2]
    assert "planning call failed" in errors[3] and "prompt too long" in errors[3]
    assert errors[4] == r"step 0: instruction holds a lone surrogate \ud800, which is not valid Unicode"
    assert by_query[5]["valid"] and orjson.loads(by_query[5]["steps_json"])["steps"][0]["worker"] == "fast"
    assert all(by_query[i]["valid"] for i in range(5, len(q)))
    assert summary["statuses"].get("ok", 0) > 0  # the good plans ran


def test_a_bad_key_or_model_stops_planning_without_rerun_advice(sim, tmp_path, queries, planner):
    planner.replies = {i: (401, b'{"error": {"message": "invalid api key"}}') for i in range(len(planner.questions))}
    with pytest.raises(ConductorError) as e:
        run(tmp_path, sim, planner, queries)
    assert "LLM planner: cannot plan:" in str(e.value) and "rejected" in str(e.value)
    assert "rerun" not in str(e.value)


def test_a_server_error_still_stops_planning_for_a_rerun_and_counts_only_those(sim, tmp_path, queries, planner):
    planner.replies = {0: (503, b'{"error": {"message": "overloaded"}}'), 1: (200, b"<html>oops</html>")}
    with pytest.raises(ConductorError, match=re.escape(f"1 of {len(planner.questions)} planning call(s) failed")) \
            as e:
        run(tmp_path, sim, planner, queries, run_id="r")
    assert "overloaded" in str(e.value) and "rerun the same command" in str(e.value)

    planner.replies = {1: (200, b"<html>oops</html>")}  # the server is back: the rerun finishes planning
    _, plans = run(tmp_path, sim, planner, queries, run_id="r")
    assert [p["query_index"] for p in plans if not p["valid"]] == [1]


def test_a_query_the_planner_always_fails_is_final_after_three_reruns(sim, tmp_path, queries, planner):
    """A question the provider answers 503 every time cannot hold the job back for ever:
    the first run and three reruns stop planning for a rerun; the fourth plans it as
    invalid, for good, and runs the rest."""
    planner.replies = {0: (503, b'{"error": {"message": "overloaded"}}')}
    for attempt in range(1, 4):
        with pytest.raises(ConductorError, match="rerun the same command"):
            run(tmp_path, sim, planner, queries, run_id="r")
        assert planner.asked[0] == attempt
    summary, plans = run(tmp_path, sim, planner, queries, run_id="r")
    assert planner.asked[0] == 4
    bad = [p for p in plans if not p["valid"]]
    assert [p["query_index"] for p in bad] == [0]
    assert "failed on 4 runs" in bad[0]["error"] and "overloaded" in bad[0]["error"]
    assert "final" in bad[0]["error"]
    assert summary["statuses"].get("ok", 0) > 0  # the other queries ran
    assert all(n == 1 for i, n in planner.asked.items() if i != 0)  # finished planning is never asked again


def test_a_query_whose_planning_failed_for_good_is_not_asked_again_by_a_rerun(sim, tmp_path, queries, planner):
    """While another query's 503 keeps planning unfinished, each rerun asked (and paid for) the
    refused query again."""
    planner.replies = {0: (200, completion(None)), 1: (503, b'{"error": {"message": "overloaded"}}')}
    for attempt in range(1, 4):
        with pytest.raises(ConductorError, match="rerun the same command"):
            run(tmp_path, sim, planner, queries, run_id="r")
        assert planner.asked == {**{i: 1 for i in range(len(planner.questions)) if i != 1}, 1: attempt}
    summary, plans = run(tmp_path, sim, planner, queries, run_id="r")
    assert planner.asked[0] == 1 and planner.asked[1] == 4
    errors = {p["query_index"]: p["error"] for p in plans if not p["valid"]}
    assert set(errors) == {0, 1} and "no text content" in errors[0] and "final" in errors[0]


def test_a_refused_planning_call_is_charged_what_it_used(sim, tmp_path, queries, planner):
    """A 200 with no content (a refusal, a content filter) is billed: the plan is invalid,
    and planning's cost holds the call's usage at the planner's price."""
    planner.replies = {0: (200, completion(None))}  # usage: 10 prompt, 5 completion tokens
    summary, plans = run(tmp_path, sim, planner, queries)
    price = plannersim.PLANNER_PRICE
    one = (10 * price["input_per_mtok"] + 5 * price["output_per_mtok"]) / 1e6
    refused = next(p for p in plans if p["query_index"] == 0)
    assert not refused["valid"] and "no text content" in refused["error"]
    assert orjson.loads(refused["info_json"])["cost_usd"] == pytest.approx(one)
    good = sum(orjson.loads(p["info_json"])["cost_usd"] for p in plans if p["valid"])
    assert good > 0
    assert summary["planning_cost_usd"] == pytest.approx(good + one, rel=1e-9)


def test_retry_failed_plans_again_a_query_whose_planning_failed_once_planning_has_finished(sim, tmp_path, queries,
                                                                                          planner):
    """A refused planning call makes a final invalid plan, and the run completes without it. Planning
    had finished, so --retry-failed kept the invalid plan (a new --run-id was the only way): it now
    asks the planner again for that query alone, runs the new plan, and leaves the others as they ran."""
    planner.replies = {0: (200, completion(None))}
    summary, plans = run(tmp_path, sim, planner, queries, run_id="r")
    assert summary["statuses"]["invalid_plan"] == 1 and "--retry-failed does" in plans[0]["error"]
    assert run(tmp_path, sim, planner, queries, run_id="r")[0]["statuses"]["invalid_plan"] == 1  # a plain rerun
    assert planner.asked[0] == 1
    planner.replies = {}  # the provider answers it now
    sim.reset()
    summary, plans = run(tmp_path, sim, planner, queries, run_id="r", retry_failed=True)
    assert planner.asked[0] == 2 and all(n == 1 for i, n in planner.asked.items() if i != 0)
    assert all(p["valid"] for p in plans) and len(plans) == len(planner.questions)
    assert summary["statuses"].get("invalid_plan", 0) == 0
    results = pq.read_table(tmp_path / "data" / "runs" / "r" / "results.parquet").to_pylist()
    assert next(r for r in results if r["query_index"] == 0)["status"] == "ok"
    assert sim.log()["total"] == 1  # only the new plan's one step was sent to the workers
    sim.reset()
    again = run(tmp_path, sim, planner, queries, run_id="r")[0]  # and a plain rerun finds nothing to do
    assert again["statuses"] == summary["statuses"] and sim.log()["total"] == 0 and planner.asked[0] == 2
