"""What the failure list says of a function step (vote, extract): it runs locally on the same
inputs, so a rerun with --retry-failed fails it the same way; the list advised that rerun and
named its URL "(provider default)" (audit68 F8)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from conductor.failures import failure_groups, format_failures
from conductor.pool import load_pool


def test_a_failed_function_step_is_said_to_need_another_plan_not_a_retry(tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"workers": [
        {"id": "w1", "model": "openai/w1", "api_base": "http://127.0.0.1:9/v1"},
        {"id": "extract", "kind": "function", "function": "extract"}]}))
    run = tmp_path / "run"
    (run / "work").mkdir(parents=True)
    (run / "work" / "steps.jsonl").write_text("")
    pq.write_table(pa.table({
        "plan_id": ["p1", "p1", "p1", "p2"], "worker": ["w1", "w1", "extract", "w1"],
        "status": ["ok", "ok", "error", "error"], "failure": [None, None, "other", "auth"],
        "error": [None, None, "extract needs access to exactly one earlier step that ran (got 2)",
                  "worker w1: the provider rejected the API key"]}), run / "traces.parquet")
    text = format_failures(failure_groups(run / "traces.parquet", load_pool(pool)))
    extract, w1 = [line for line in text.splitlines() if line.startswith("  worker")]
    assert extract.startswith("  worker extract (a function, run locally): other, 1 plan(s); final: a function "
                              "step fails the same way on every rerun, on the same inputs"), text
    assert "--retry-failed" not in extract and "provider default" not in text
    assert w1.endswith("auth, 1 plan(s); final (rerun with --retry-failed)"), text  # an LLM step: as before
