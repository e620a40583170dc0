"""A failed step's trace row shows when it started (audit77 F1): a step that spent seconds
retrying showed `started_at` = `ended_at`, a span of 0 s, and sorted after steps that ran
beside it.

Real parts: run_all with a fixed plan, the simulated LLM server over HTTP answering 429 with
`retry-after-ms`, the traces Parquet file a user queries."""

from __future__ import annotations

import pyarrow.parquet as pq

from tests.conftest import write_pool
from tests.test_executor import FixedPlanner, run

WAIT_S = 0.3  # the retry-after the server asks for, between each of the step's attempts


def two_steps(q):
    """Step 0 on the worker the server rate-limits, step 1 beside it on a healthy one."""
    return [{"worker": "flaky", "instruction": f"{q.prompt}\nEnd with 'Answer: ...'", "access": []},
            {"worker": "fast", "instruction": f"{q.prompt}\nEnd with 'Answer: ...'", "access": []}]


def test_a_step_that_failed_after_retries_spans_its_retries_in_the_traces(tmp_path, fresh_sim, sample_queries):
    fresh_sim.set_faults("flaky", rate_limit_rate=1.0, retry_after_ms=WAIT_S * 1000)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("flaky", "fast"),
                      providers={"sim": {"max_concurrency": 8, "timeout_s": 10, "max_attempts": 3}})
    queries = tmp_path / "q2.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 2), queries)
    _, traces, results = run(tmp_path, pool, queries, FixedPlanner(two_steps), cache=False)
    assert {r["status"] for r in results} == {"error"}
    started = {r["plan_id"]: r["started_at"] for r in results}
    for plan_id in started:
        failed, ok = sorted((t for t in traces if t["plan_id"] == plan_id), key=lambda t: t["step"])
        assert (failed["status"], failed["attempts"], ok["status"]) == ("error", 3, "ok"), failed["error"]
        # the server asked for WAIT_S before each retry: the row's span holds those waits
        assert (failed["ended_at"] - failed["started_at"]).total_seconds() >= WAIT_S * 2
        # both steps started with the plan: ordered by start, the failed step is not after its sibling's end
        assert started[plan_id] <= failed["started_at"] <= ok["ended_at"]
        assert failed["request_key"] is None  # no answer was received (see the column's description)
