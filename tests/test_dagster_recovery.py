"""`dagster dev` killed mid-run, as a crash or a reboot kills it, then started again on
the same instance: the run it left STARTED must be failed by the `dead_runs` sensor and
resumed by the instance's run retries, with nothing paid for twice. The whole chain is
real: the inbox sensor starts the run, the daemon launches it, SIGKILL ends every
process of `dagster dev`, and the second `dagster dev`'s daemons finish the job."""

import json
import os
import shutil
import signal
import time

import pyarrow.parquet as pq
import pytest
from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

from tests import dagster_dev as dev
from tests.conftest import REPO, write_pool

pytestmark = pytest.mark.slow

PARENT_TAG = "dagster/parent_run_id"


def runs(home, **filters):
    with DagsterInstance.from_config(str(home)) as instance:
        return instance.get_runs(RunsFilter(**filters))


def wait_for(what, predicate, timeout, log):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}; see {log}"
        time.sleep(1)
    return found


def test_a_run_cut_off_by_dagster_dev_dying_is_finished_by_the_next_dagster_dev(
        tmp_path, monkeypatch, fresh_sim, sample_queries):
    fresh_sim.set_faults("*", latency_ms=250)  # 60 plans at 2 in flight: long enough to kill mid-run
    home, data = tmp_path / "dagster_home", tmp_path / "data"
    home.mkdir()
    shutil.copy(REPO / "data" / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, providers={"sim": {"max_concurrency": 2, "timeout_s": 10}})
    env = {**os.environ, "DAGSTER_HOME": str(home), "CONDUCTOR_DATA_DIR": str(data), "CONDUCTOR_POOL": str(pool),
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONUNBUFFERED": "1"}
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # dagster.yaml reads it for its storage paths
    (data / "inbox").mkdir(parents=True)
    shutil.copy(sample_queries, data / "inbox" / "mixed-60.parquet")  # the inbox sensor starts the run
    log_path = tmp_path / "dagster_dev.log"
    with open(log_path, "w") as log:
        first = dev.start(env, dev.free_port(), log)
        try:
            wait_for("a few calls of the run", lambda: fresh_sim.log()["total"] >= 6, 180, log_path)
        finally:
            dev.stop(first, signal.SIGKILL)
            dev.kill_every_process_of(home)
        [cut] = runs(home)
        assert cut.status == DagsterRunStatus.STARTED  # nothing else will ever end it
        sent_before = fresh_sim.log()["total"]
        assert sent_before < 60

        second = dev.start(env, dev.free_port(), log)
        try:
            retried = wait_for("the retry of the cut-off run to succeed", lambda: [
                r for r in runs(home, tags={PARENT_TAG: cut.run_id}) if r.status == DagsterRunStatus.SUCCESS],
                240, log_path)
        finally:
            dev.stop(second)

    with DagsterInstance.from_config(str(home)) as instance:
        failure = [e for e in instance.all_logs(cut.run_id) if e.dagster_event and e.dagster_event.is_run_failure]
    assert "worker process" in failure[0].dagster_event.message and "is gone" in failure[0].dagster_event.message
    assert len(retried) == 1 and runs(home, statuses=[DagsterRunStatus.STARTED]) == []
    [run_dir] = (data / "runs").iterdir()
    results = pq.read_table(run_dir / "results.parquet").to_pylist()
    assert len(results) == 60 and {r["status"] for r in results} == {"ok"}
    summary = json.loads((run_dir / "summary.json").read_text())
    lost = summary["lost_in_flight"]["calls"]
    assert lost <= 2  # at most what was in flight when the processes died
    assert fresh_sim.log()["total"] == summary["calls"] + lost  # every call the server saw is paid once, or lost
