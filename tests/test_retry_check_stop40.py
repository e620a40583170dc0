"""--retry-failed asks the LLM planner again for the queries whose planning failed: those planning
calls were paid before any worker was checked, so an unset key was found after them (stop 39's
carried item; a new run's planning has had the check since audit65 F1)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from conductor.errors import ConductorError
from conductor.runner import RunConfig, run_all
from tests import plannersim
from tests.plannersim import psim, queries, sim  # noqa: F401  (shared fixtures)
from tests.test_planner_replies import Planner, completion

pytestmark = pytest.mark.slow  # the LLM planner over HTTP


@pytest.fixture
def planner(queries):
    p = Planner(pq.read_table(queries).column("prompt").to_pylist())
    yield p
    p.close()


def test_retry_failed_checks_the_workers_before_planning_again(sim, tmp_path, queries, planner, monkeypatch):
    pool = plannersim.pool_file(
        tmp_path / "pool.yaml", sim.url,
        planner=plannersim.planner_worker(planner.url, model="fakeplanner", provider="fp"),
        providers={"sim": {"max_concurrency": 16, "timeout_s": 10, "api_key_env": "STOP40_SIM_KEY"},
                   "fp": {"max_attempts": 1, "timeout_s": 10}})
    cfg = dict(queries=queries, pool=pool, data_dir=tmp_path / "data", run_id="r", progress=False, planner="llm",
               planner_options={"worker": "conductor", "structured": "off"}, cache=False)
    monkeypatch.setenv("STOP40_SIM_KEY", "anything")
    planner.replies = {0: (200, completion(None))}  # query 0's planning call fails for good
    summary = run_all(RunConfig(**cfg))
    assert summary["statuses"]["invalid_plan"] == 1 and planner.asked[0] == 1
    planner.replies = {}
    monkeypatch.delenv("STOP40_SIM_KEY")  # and now the workers' key is gone
    with pytest.raises(ConductorError) as refused:
        run_all(RunConfig(**cfg, retry_failed=True))
    assert getattr(refused.value, "exit_code", 2) == 2, refused.value  # what `conductor run` exits with
    assert str(refused.value).startswith("cannot start planning (no call was made): provider sim"), refused.value
    assert "environment variable STOP40_SIM_KEY is not set (needed by fast, weak)" in str(refused.value)
    assert planner.asked[0] == 1  # not asked (and paid) again before the refusal
    monkeypatch.setenv("STOP40_SIM_KEY", "anything")
    summary = run_all(RunConfig(**cfg, retry_failed=True))  # the fixed command plans it again and runs it
    assert planner.asked[0] == 2 and summary["statuses"].get("invalid_plan", 0) == 0
    assert summary["run_id"] == "r" and summary["resumed"]
