"""A query set of `code` questions run end to end: recorded answers served by `conductor replay serve`
over real HTTP, their tests run in sandboxes side by side when the run is graded, rewards as a user
reads them."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from conductor.runner import RunConfig, run_all
from tests.replayserve import served_table

pytestmark = pytest.mark.slow  # a replay server and sandboxes

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
ANSWERS = {  # question -> (model a's answer, model b's answer)
    "right": ("```python\ndef add(a, b):\n    return a + b\n```",
              "```python\ndef add(a, b):\n    return b + a\n```"),
    "wrong": ("```python\ndef add(a, b):\n    return a - b\n```", "```python\nimport sys\ndef add(a, b):\n"
              "    return 0\nsys.exit(0)\n```"),  # exiting before the tests does not pass
    "usage": ("```python\ndef add(a, b):\n    return a + b\n```\nUse it:\n```python\nprint(add(1, 2))\n```",
              "```python\nclass A:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return A()\n```"),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("code")
    rows = [{"question_id": f"q-{name}", "question": f"Write add(a, b) ({name}).", "reference": TESTS,
             "model": m, "response": answer, "correct": None, "task": "code", "cost_usd": 0.001}
            for name, answers in ANSWERS.items() for m, answer in zip("ab", answers)]
    with served_table(d, rows, "code_logs") as served:
        yield served


@pytest.mark.parametrize("worker, expected", [
    ("a", {"q-right": True, "q-wrong": False, "q-usage": True}),
    ("b", {"q-right": True, "q-wrong": False, "q-usage": False}),
])
def test_a_code_query_set_is_graded_by_running_the_answers_tests(served, monkeypatch, worker, expected):
    monkeypatch.setenv("CONDUCTOR_REPLAY_URL", served["server"].url)
    data = served["dir"] / "data"
    summary = run_all(RunConfig(queries=served["queries"], pool=served["pool"], data_dir=data,
                                run_id=f"code-{worker}", progress=False, cache=False,
                                planner_options={"policy": "none", "action": f"single:{worker}"}))
    rewards = pq.read_table(data / "runs" / summary["run_id"] / "rewards.parquet").to_pylist()
    assert {r["query_id"]: r["correct"] for r in rewards} == expected
    assert all(r["reward"] == (1.0 if r["correct"] else 0.5) for r in rewards)  # parsed, so 0.5 when wrong
