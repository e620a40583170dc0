"""The Dagster front end: workspace.yaml loads; one query-set partition
materializes end to end against the simulated pool, with its metadata, checks
and provider pools; rematerializing it resumes; a failing blocking check stops
the assets downstream; the daily enrichment job runs with the schedule's config."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from dagster import (AssetCheckSeverity, AssetKey, DagsterInstance, DagsterRunStatus, Definitions, RunsFilter,
                     build_schedule_context, materialize)

from assets.pipeline import executions, plans, query_set, rewards, run_report
from assets import checks, resources
from pipelines.definitions import defs
from pipelines.jobs import PIPELINE
from assets.resources import PlannerResource, StorageResource
from conductor.errors import ConductorError
from tests.conftest import REPLAY, REPO, worker, write_pool

# slow: real Dagster materializations and the workspace loaded in a subprocess
pytestmark = pytest.mark.slow

INSTANCE_YAML = REPO / "data" / "dagster_home" / "dagster.yaml"
ASSETS = [query_set, plans, executions, rewards, run_report]


def conductor_env(root: Path, pool: Path, **extra: str) -> dict[str, str]:
    """CONDUCTOR_* settings that keep every file of a test under `root`."""
    return {"CONDUCTOR_DATA_DIR": str(root / "data"), "CONDUCTOR_POOL": str(pool), **extra}


@pytest.fixture
def instance(tmp_path, monkeypatch):
    """A real SQLite instance configured by the checked-in dagster.yaml."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(INSTANCE_YAML, home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with DagsterInstance.from_config(str(home)) as inst:
        yield inst


def add_partition(instance: DagsterInstance, res: dict, key: str, source: Path) -> None:
    store = Path(res["query_files"].store)
    store.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, store / f"{key}.parquet")
    instance.add_dynamic_partitions("query_sets", [key])


def two_provider_pool(path: Path, url: str) -> Path:
    return write_pool(path, url, providers={"alpha": {"max_concurrency": 16, "budget_usd": 5.0},
                                            "beta": {"max_concurrency": 16}},
                      workers=[worker("fast", url, provider="alpha"), worker("weak", url, provider="beta")])


def test_workspace_yaml_loads_the_definitions(tmp_path):
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    shutil.copy(INSTANCE_YAML, tmp_path / "dagster.yaml")
    r = subprocess.run([sys.executable, "-m", "dagster", "definitions", "validate", "-w", "workspace.yaml"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "All code locations passed validation" in r.stdout + r.stderr
    keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    assert set(PIPELINE) | {"worker_stats"} <= keys
    assert defs.resolve_job_def("run_query_set").partitions_def.name == "query_sets"
    assert defs.resolve_sensor_def("query_set_inbox").job_name == "run_query_set"
    assert defs.resolve_schedule_def("daily_enrichment").job_name == "enrich_catalog"
    assert not list(REPO.glob(".tmp_dagster_home_*"))


def test_partition_materializes_end_to_end_and_reruns_as_a_resume(tmp_path, instance, fresh_sim, sample_queries):
    pool = two_provider_pool(tmp_path / "pool.yaml", fresh_sim.url)
    res = resources.from_env(conductor_env(tmp_path, pool))
    add_partition(instance, res, "small", sample_queries)
    # A second query set, materialized first: each partition's checks must read their own partition.
    tiny = tmp_path / "tiny.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 6), tiny)
    add_partition(instance, res, "tiny", tiny)
    assert materialize(ASSETS + checks.ALL, partition_key="tiny", instance=instance, resources=res).success
    fresh_sim.reset()

    result = materialize(ASSETS + checks.ALL, partition_key="small", instance=instance, resources=res)
    assert result.success
    mats = {e.asset_key.to_user_string(): e.materialization.metadata
            for e in result.get_asset_materialization_events()}
    assert set(PIPELINE) == set(mats)
    for name, md in mats.items():  # row counts, column schema and a preview on every asset
        assert md["dagster/row_count"].value > 0, name
        assert md["dagster/column_schema"].value.columns, name
        assert md["preview"].value.startswith("| "), name
    assert mats["query_set"]["dagster/row_count"].value == 60
    assert "query_id" in {c.name for c in mats["query_set"]["dagster/column_schema"].value.columns}
    assert mats["plans"]["valid_share"].value == 1.0
    # One slot in the pool of each provider of the pool file, none for the embedded planner.
    assert mats["executions"]["pools"].value == ["provider-alpha", "provider-beta"]
    assert mats["plans"]["pools"].value == []
    calls = fresh_sim.log()["total"]
    assert mats["executions"]["calls"].value == calls > 0
    assert mats["executions"]["cost_usd"].value > 0
    assert mats["executions"]["new_calls"].value == calls
    assert mats["executions"]["new_cost_usd"].value == pytest.approx(mats["executions"]["cost_usd"].value)
    acc = mats["rewards"]["accuracy"].value
    assert 0 < acc < 1 and mats["run_report"]["accuracy"].value == acc
    assert mats["run_report"]["cost_usd"].value == pytest.approx(mats["executions"]["cost_usd"].value)
    assert mats["run_report"]["chart"].value.startswith("![accuracy and cost by task](data:image/png;base64,")
    chart = Path(mats["run_report"]["chart_path"].value)
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"math", "choice", "exact"} <= {c.split(" | ")[0].strip("| ") for c in
                                           mats["run_report"]["preview"].value.splitlines()[2:]}

    evals = {(e.asset_key.to_user_string(), e.check_name): e for e in result.get_asset_check_evaluations()}
    assert set(evals) == {(c.asset_key.to_user_string(), c.name) for d in checks.ALL for c in d.check_keys}
    assert all(e.passed for e in evals.values()), {k: e.description for k, e in evals.items() if not e.passed}

    # The pools exist with the instance's default limit, and no slot outlives the step.
    limits = {p.name: p.limit for p in instance.event_log_storage.get_pool_limits()}
    assert limits == {"provider-alpha": 1, "provider-beta": 1}
    for name in limits:
        assert not instance.event_log_storage.get_concurrency_info(name).claimed_slots

    # Rerunning the partition resumes the same conductor run: nothing is called twice.
    again = materialize(ASSETS, partition_key="small", instance=instance, resources=res)
    assert again.success
    assert again.output_for_node("query_set").run_id == result.output_for_node("query_set").run_id
    assert fresh_sim.log()["total"] == calls
    rerun = {e.asset_key.to_user_string(): e.materialization.metadata
             for e in again.get_asset_materialization_events()}["executions"]
    assert rerun["new_calls"].value == 0 and rerun["new_cost_usd"].value == 0  # the run's totals stay beside them
    assert rerun["cost_usd"].value == mats["executions"]["cost_usd"].value
    run_dir = tmp_path / "data" / "runs" / result.output_for_node("query_set").run_id
    assert pq.ParquetFile(run_dir / "results.parquet").metadata.num_rows == 60

    # The daily schedule's run config drives the enrichment job over the runs so far.
    schedule = defs.resolve_schedule_def("daily_enrichment")
    request = schedule.evaluate_tick(build_schedule_context(instance=instance)).run_requests[0]
    job = defs.resolve_job_def("enrich_catalog")
    enrich = job.execute_in_process(run_config=request.run_config, instance=instance, resources=res)
    assert enrich.success
    stats = pq.read_table(tmp_path / "data" / "enrichment" / "worker_stats.parquet").to_pylist()
    assert {r["worker"] for r in stats} == {"fast", "weak"}
    assert {r["provider"] for r in stats} == {"alpha", "beta"}
    used: dict[str, int] = {}  # plans that used each worker, over both partitions' runs
    for plans_file in (tmp_path / "data" / "runs").glob("*/plans.parquet"):
        for ws in pq.read_table(plans_file, columns=["workers"]).column("workers").to_pylist():
            for w in set(ws):
                used[w] = used.get(w, 0) + 1
    plans_per_worker: dict[str, int] = {}
    for r in stats:
        plans_per_worker[r["worker"]] = plans_per_worker.get(r["worker"], 0) + r["plans"]
        assert 0 <= r["accuracy_when_used"] <= 1 and r["cost_usd"] > 0
    assert plans_per_worker == used
    assert instance.get_latest_materialization_event(AssetKey("worker_stats")) is not None


def test_failing_blocking_check_stops_the_run_before_any_call(tmp_path, fresh_sim, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    res = resources.from_env(conductor_env(tmp_path, pool))
    # Verify-only plans have two steps: with max_steps 1 every plan is invalid.
    res["planner"] = PlannerResource(options_json='{"templates": ["verify"]}', max_steps=1)
    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "small", sample_queries)
        result = materialize(ASSETS + checks.ALL, partition_key="small", instance=inst, resources=res,
                             raise_on_error=False)
    assert not result.success
    done = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert done == {"query_set", "plans"}
    failed = {(e.asset_key.to_user_string(), e.check_name) for e in result.get_asset_check_evaluations()
              if not e.passed}
    assert ("plans", "valid_plan_share") in failed
    assert fresh_sim.log()["total"] == 0


def test_a_user_error_in_executions_fails_at_once_instead_of_retrying(tmp_path, sample_queries, monkeypatch):
    monkeypatch.delenv("CONDUCTOR_TEST_UNSET_KEY", raising=False)
    pool = write_pool(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1",
                      providers={"sim": {"api_key_env": "CONDUCTOR_TEST_UNSET_KEY"}})
    res = resources.from_env(conductor_env(tmp_path, pool))
    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "small", sample_queries)
        result = materialize(ASSETS, partition_key="small", instance=inst, resources=res, raise_on_error=False)
    assert not result.success
    events = {e.event_type_value for e in result.all_events}
    assert "STEP_UP_FOR_RETRY" not in events  # the RetryPolicy is for crashes and timeouts, not for this
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failure.step_key == "executions"
    assert "CONDUCTOR_TEST_UNSET_KEY is not set" in str(failure.event_specific_data.error.message)


def test_a_terminated_executions_step_is_not_retried(tmp_path, fresh_sim, sample_queries):
    """Dagster retries an interrupted step that has a retry policy: the UI's Terminate made
    `executions` resume at once and send the calls the user had stopped (audit 31)."""
    import os
    import signal
    import threading
    import time

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("slow",), providers={"sim": {"max_concurrency": 2}})
    res = resources.from_env(conductor_env(tmp_path, pool))

    def terminate_once_calls_flow():
        while fresh_sim.log()["total"] < 4:
            time.sleep(0.02)
        [run] = inst.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED]))
        inst.report_run_canceling(run)  # what Dagster's Terminate does, then it signals the step
        os.kill(os.getpid(), signal.SIGINT)

    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "small", sample_queries)
        assert materialize(ASSETS, selection=["query_set", "plans"], partition_key="small", instance=inst,
                           resources=res).success
        threading.Thread(target=terminate_once_calls_flow, daemon=True).start()
        result = materialize(ASSETS, selection=["executions"], partition_key="small", instance=inst, resources=res,
                             raise_on_error=False)
    assert not result.success
    assert "STEP_UP_FOR_RETRY" not in step_events(result, "executions")
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "the run was terminated" in str(failure.event_specific_data.error.message)
    sent = fresh_sim.log()["total"]
    time.sleep(1.0)
    assert fresh_sim.log()["total"] == sent < 60  # stopped: nothing sent after, most plans left


def test_a_provider_down_fails_the_failed_share_check_and_a_rematerialization_finishes(
        tmp_path, fresh_sim, sample_queries):
    """Every call dropped: executions materializes with every plan failed, its blocking
    failed_share check fails naming worker and URL, and rewards does not run. With the
    provider back, re-materializing retries those plans only and goes through."""
    fresh_sim.set_faults("fast", drop_rate=1.0)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",),
                      providers={"sim": {"max_concurrency": 16, "max_attempts": 1}})
    res = resources.from_env(conductor_env(tmp_path, pool))
    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "small", sample_queries)
        result = materialize(ASSETS + checks.ALL, partition_key="small", instance=inst, resources=res,
                             raise_on_error=False)
        assert not result.success
        done = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
        assert done == {"query_set", "plans", "executions"}  # rewards is blocked
        [check] = [e for e in result.get_asset_check_evaluations() if e.check_name == "failed_share"]
        assert not check.passed
        assert "60 of 60 plans failed" in check.description
        assert f"worker fast at {fresh_sim.url}: connection" in check.description
        # Dagster's default button for a failed run reruns only the check: the way out is named.
        assert "materialize the partition again to retry (Re-execute from failure reruns only" in check.description

        md = {e.asset_key.to_user_string(): e.materialization.metadata
              for e in result.get_asset_materialization_events()}["executions"]
        # Nothing paid, but every attempt was sent: an outage shows as requests with no calls.
        assert md["new_calls"].value == 0 and md["new_requests"].value >= 60
        run_dir = Path(md["traces_path"].value).parent
        assert md["run_id"].value == run_dir.name and md["parquet_path"].value == str(run_dir / "results.parquet")

        fresh_sim.clear_faults()
        fresh_sim.reset()
        again = materialize(ASSETS + checks.ALL, partition_key="small", instance=inst, resources=res)
        assert again.success
        [check] = [e for e in again.get_asset_check_evaluations() if e.check_name == "failed_share"]
        assert check.passed
    assert fresh_sim.log()["total"] == 60  # each failed plan's one call, nothing sent twice


# A partition's run in its own process, as the daemon's run launcher starts the
# runs of a backfill, with the definitions' executor.
PARTITION_RUN = """
import sys
from dagster import DagsterInstance, execute_job, reconstructable


def job():
    from pipelines.definitions import defs

    return defs.resolve_job_def("run_query_set")


if __name__ == "__main__":
    with DagsterInstance.get() as instance:
        result = execute_job(reconstructable(job), instance, tags={"dagster/partition": sys.argv[1]})
        print("RUN_ID", result.run_id)
        sys.exit(0 if result.success else 1)
"""


def test_with_a_shared_governor_a_backfills_partitions_run_at_once_on_one_provider_limit(
        tmp_path, instance, fresh_sim, monkeypatch):
    """Three partitions of one provider at once, each run its own process: with the
    in-process governor they would take turns in the provider's pool (limit 1); with the
    Redis governor they claim no pool, overlap, and their calls together keep to the
    provider's one rate limit."""
    from conductor.execute.shared.servers import RedisServer

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make setup-test installs Debian's)")
    rpm, partitions = 360, ["q0", "q1", "q2"]
    with RedisServer() as redis:
        pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",),
                          providers={"sim": {"max_concurrency": 8, "timeout_s": 10, "rpm": rpm}})
        doc = yaml.safe_load(pool.read_text())
        doc["governor"] = redis.url
        pool.write_text(yaml.safe_dump(doc))
        fresh_sim.set_faults("fast", rpm=rpm)  # the provider's own limit: over it, 429s
        env = conductor_env(tmp_path, pool)
        res = resources.from_env(env)
        sample = pq.read_table(REPO / "data" / "queries" / "sample.parquet")
        for i, key in enumerate(partitions):  # different queries: the shared cache must not answer them
            pq.write_table(sample.slice(60 * i, 60), tmp_path / f"{key}.parquet")
            add_partition(instance, res, key, tmp_path / f"{key}.parquet")
        script = tmp_path / "partition_run.py"
        script.write_text(PARTITION_RUN)
        full_env = {**os.environ, **env, "PYTHONPATH": str(REPO), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        full_env.pop("CONDUCTOR_GOVERNOR", None)
        procs = [subprocess.Popen([sys.executable, str(script), key], cwd=REPO, env=full_env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for key in partitions]
        run_ids = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err.decode()[-3000:]
            run_ids.append(out.decode().split("RUN_ID ")[1].split()[0])

    log = fresh_sim.log()
    assert log["by_status"].get("429", 0) == 0, log["by_status"]
    times = sorted(log["accepted_times"]["fast"])
    assert len(times) >= 180  # every query of the three partitions was answered by the sim
    # Arrivals keep to one paced limit (1% burst, then rpm over 61 s, 1.5 s for jitter);
    # three in-process governors would each go at the full rate.
    burst, per_s = max(1, rpm // 100), (rpm - max(1, rpm // 100)) / 61.0
    for i in range(0, len(times), 5):
        for j in range(i + 1, len(times)):
            assert j - i + 1 <= burst + per_s * (times[j] - times[i] + 1.5), (i, j, times[j] - times[i])

    for run_id in run_ids:
        mats = [e for e in instance.all_logs(run_id) if e.dagster_event and e.dagster_event.is_step_materialization
                and e.dagster_event.step_key == "executions"]
        assert mats[0].dagster_event.step_materialization_data.materialization.metadata["pools"].value == []
    # The three partitions' calls went out at the same time: each run's first call was sent
    # before any run's last call ended. (A step waiting for a pool has already started, so
    # the steps' own start and end would overlap even when the runs take turns.)
    spans = []
    for traces in (tmp_path / "data" / "runs").glob("*/traces.parquet"):
        t = pq.read_table(traces, columns=["started_at", "ended_at"])
        spans.append((min(t.column("started_at").to_pylist()), max(t.column("ended_at").to_pylist())))
    assert len(spans) == len(partitions)
    assert max(s for s, _ in spans) < min(e for _, e in spans), spans
    assert "provider-sim" not in {p.name for p in instance.event_log_storage.get_pool_limits()}


def small_queries(tmp_path: Path, sample_queries: Path, n: int) -> Path:
    out = tmp_path / f"q{n}.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, n), out)
    return out


def step_events(result, step: str) -> list[str]:
    return [e.event_type_value for e in result.all_events if e.step_key == step]


def test_retry_failed_reruns_plans_that_failed_for_good(tmp_path, fresh_sim, sample_queries):
    """A 404 is final: rematerializing sends nothing again, and the failed_share check says to
    rematerialize with retry_failed: true, which finishes the plans."""
    fresh_sim.set_faults("fast", fail_status=404)  # listed by the server, so past the preflight
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    res = resources.from_env(conductor_env(tmp_path, pool))
    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "ten", small_queries(tmp_path, sample_queries, 10))
        first = materialize(ASSETS + checks.ALL, partition_key="ten", instance=inst, resources=res,
                            raise_on_error=False)
        [check] = [e for e in first.get_asset_check_evaluations() if e.check_name == "failed_share"]
        assert not check.passed and "not_found x10: final (rematerialize with retry_failed: true)" in check.description
        fresh_sim.clear_faults()
        fresh_sim.reset()
        again = materialize(ASSETS + checks.ALL, partition_key="ten", instance=inst, resources=res,
                            raise_on_error=False)
        assert not again.success and fresh_sim.log()["total"] == 0  # final: nothing sent again
        retried = materialize(ASSETS + checks.ALL, partition_key="ten", instance=inst, resources=res,
                              run_config={"ops": {"query_set": {"config": {"retry_failed": True}}}})
        assert retried.success and fresh_sim.log()["total"] == 10
        md = {e.asset_key.to_user_string(): e.materialization.metadata
              for e in retried.get_asset_materialization_events()}["executions"]
        assert md["statuses"].value == {"ok": 10}
        assert retried.output_for_node("query_set").run_id == first.output_for_node("query_set").run_id


def test_a_check_whose_failures_are_all_final_says_to_fix_the_cause_not_to_materialize_again(
        tmp_path, fresh_sim, sample_queries):
    """A rejected key (401) is final: rematerializing as it is sends nothing, yet the check ended with
    "materialize the partition again to retry". It says to fix the cause, then use retry_failed: true,
    and, once that failed too, that the plans failed again under it."""
    fresh_sim.set_faults("fast", fail_status=401)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    res = resources.from_env(conductor_env(tmp_path, pool))
    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "ten", small_queries(tmp_path, sample_queries, 10))
        first = failed_share_check(materialize(ASSETS + checks.ALL, partition_key="ten", instance=inst,
                                               resources=res, raise_on_error=False))
        sent = fresh_sim.log()["total"]
        again = failed_share_check(materialize(ASSETS + checks.ALL, partition_key="ten", instance=inst,
                                               resources=res, raise_on_error=False,
                                               run_config={"ops": {"query_set": {"config": {"retry_failed": True}}}}))
    assert fresh_sim.log()["total"] == 2 * sent > 0  # retry_failed sent every plan again, and they failed again
    assert "auth x10: final (rematerialize with retry_failed: true)" in first.description, first.description
    assert "auth x10: final (they failed again under retry_failed: true: fix the cause first)" in again.description
    for check in (first, again):
        assert not check.passed and "materialize the partition again to retry" not in check.description
        assert check.description.endswith(
            "materializing the partition again as it is retries none of these: fix the cause, then rematerialize "
            "with retry_failed: true (Re-execute from failure reruns only this check, which reads the same results)")


def failed_share_check(result):
    [check] = [e for e in result.get_asset_check_evaluations() if e.check_name == "failed_share"]
    return check


def test_a_pool_made_invalid_after_planning_fails_executions_at_once(tmp_path, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1")
    res = resources.from_env(conductor_env(tmp_path, pool))
    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "small", small_queries(tmp_path, sample_queries, 6))
        assert materialize(ASSETS, selection=["query_set", "plans"], partition_key="small", instance=inst,
                           resources=res).success
        doc = yaml.safe_load(pool.read_text())
        doc["providers"]["sim"]["max_concurrency"] = "lots"
        pool.write_text(yaml.safe_dump(doc))
        result = materialize(ASSETS, selection=["executions"], partition_key="small", instance=inst, resources=res,
                             raise_on_error=False)
    assert not result.success
    assert "STEP_UP_FOR_RETRY" not in step_events(result, "executions")
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = str(failure.event_specific_data.error.message)
    assert str(pool) in message and "max_concurrency" in message, message


def test_a_bad_max_failed_share_fails_before_any_call(tmp_path, fresh_sim, sample_queries, monkeypatch):
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    res = resources.from_env(conductor_env(tmp_path, pool))
    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "small", small_queries(tmp_path, sample_queries, 6))
        assert materialize(ASSETS, selection=["query_set", "plans"], partition_key="small", instance=inst,
                           resources=res).success
        for bad in ("2", "five percent"):
            monkeypatch.setenv("CONDUCTOR_MAX_FAILED_SHARE", bad)
            for selection in (["plans", "executions"], ["executions"]):
                result = materialize(ASSETS + checks.ALL, selection=selection, partition_key="small", instance=inst,
                                     resources=res, raise_on_error=False)
                assert not result.success
                [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
                assert failure.step_key == selection[0]
                assert f"CONDUCTOR_MAX_FAILED_SHARE={bad!r}: expected a share" in \
                    failure.event_specific_data.error.to_string()
                assert "STEP_UP_FOR_RETRY" not in step_events(result, "executions")
    assert fresh_sim.log()["total"] == 0


def test_a_budget_stopped_run_fails_and_a_rerun_with_room_finishes_it(tmp_path, fresh_sim, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    res = resources.from_env(conductor_env(tmp_path, pool))
    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "small", small_queries(tmp_path, sample_queries, 20))
        result = materialize(ASSETS + checks.ALL, partition_key="small", instance=inst, resources=res,
                             run_config={"ops": {"query_set": {"config": {"budget_usd": 0.002}}}},
                             raise_on_error=False)
        assert not result.success  # unattended: an unfinished run must not look green
        done = {e.asset_key.to_user_string(): e.materialization.metadata for e in
                result.get_asset_materialization_events()}
        assert "rewards" not in done and "run_report" not in done  # no accuracy over the plans that fit
        stopped = done["executions"]["statuses"].value["budget_exhausted"]
        [check] = [e for e in result.get_asset_check_evaluations() if e.check_name == "no_budget_stop"]
        assert not check.passed and check.severity == AssetCheckSeverity.ERROR
        assert f"{stopped} of 20 plans stopped by a budget" in check.description
        assert "budget_usd" in check.description and "finished plans are not paid again" in check.description
        assert "materialize rewards and run_report alone" in check.description
        [share] = [e for e in result.get_asset_check_evaluations() if e.check_name == "failed_share"]
        assert "budget" in share.description and "retries these" not in share.description  # the same budget would not
        assert "a rematerialization with a larger budget finishes these" in share.description
        as_it_stands = materialize(ASSETS, selection=["rewards", "run_report"], partition_key="small",
                                   instance=inst, resources=res)
        report = {e.asset_key.to_user_string(): e.materialization.metadata for e in
                  as_it_stands.get_asset_materialization_events()}["run_report"]
        calls = fresh_sim.log()["total"]
        [statuses] = [line for line in report["summary"].value.splitlines() if line.startswith("| statuses |")]
        assert f"budget_exhausted {stopped}" in statuses and 0 < stopped < 20, statuses  # says why it is partial
        assert f"| graded | {20 - stopped} |" in report["summary"].value
        finished = materialize(ASSETS + checks.ALL, partition_key="small", instance=inst, resources=res,
                               run_config={"ops": {"query_set": {"config": {"budget_usd": 1.0}}}})
        [check] = [e for e in finished.get_asset_check_evaluations() if e.check_name == "no_budget_stop"]
        assert check.passed
        assert fresh_sim.log()["total"] - calls == stopped  # only the stopped plans were paid for


def test_bad_numeric_settings_name_the_variable_and_fail_only_what_uses_them(tmp_path, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1")
    for name, value in [("CONDUCTOR_MIN_VALID_SHARE", "high"), ("CONDUCTOR_MIN_VALID_SHARE", "1.5"),
                        ("CONDUCTOR_MAX_RUN_USD", "-1"), ("CONDUCTOR_MAX_RUN_USD", "nan"),
                        ("CONDUCTOR_MAX_RUN_USD", "ten")]:
        res = resources.from_env(conductor_env(tmp_path, pool, **{name: value}))  # the location still loads
        Definitions(assets=ASSETS, asset_checks=checks.ALL, resources=res).resolve_all_job_defs()
        with DagsterInstance.ephemeral() as inst:
            add_partition(inst, res, "small", small_queries(tmp_path, sample_queries, 6))
            result = materialize(ASSETS + checks.ALL, partition_key="small", instance=inst, resources=res,
                                 raise_on_error=False)
        assert not result.success and not result.get_asset_materialization_events()  # failed at the run's start
        [failure] = [e for e in result.all_events if e.event_type_value == "RESOURCE_INIT_FAILURE"]
        assert f"{name}={value!r}: expected" in failure.event_specific_data.error.to_string()
    ok = resources.from_env({"CONDUCTOR_MIN_VALID_SHARE": "0.5", "CONDUCTOR_MAX_RUN_USD": "2.5"})["checks"]
    assert (ok.min_valid_share, ok.max_run_usd) == (0.5, 2.5)
    assert resources.from_env({"CONDUCTOR_MAX_RUN_USD": ""})["checks"].max_run_usd is None

    bad_json = resources.from_env({"CONDUCTOR_PLANNER_OPTIONS": "{bad"})["planner"]
    with pytest.raises(ConductorError, match="CONDUCTOR_PLANNER_OPTIONS"):
        bad_json.options()
    with pytest.raises(ConductorError, match="CONDUCTOR_PLANNER_OPTIONS"):
        resources.from_env({"CONDUCTOR_PLANNER_OPTIONS": "[1]"})["planner"].options()


def test_bad_schedule_settings_name_the_variable():
    from pipelines import schedules

    for env, message in [({"CONDUCTOR_ENRICH_JOBS_HOUR": "25"}, "CONDUCTOR_ENRICH_JOBS_HOUR='25': expected an hour"),
                         ({"CONDUCTOR_ENRICH_JOBS_HOUR": "four"}, "CONDUCTOR_ENRICH_JOBS_HOUR='four'")]:
        with pytest.raises(ConductorError, match=message):
            schedules.daily_enrich_jobs(env)
    with pytest.raises(ConductorError, match="CONDUCTOR_ENRICH_CRON='0 3 \\* \\*'"):
        schedules.daily_enrichment({"CONDUCTOR_ENRICH_CRON": "0 3 * *"})
    schedules.daily_enrich_jobs({"CONDUCTOR_ENRICH_JOBS_HOUR": "0"})
    # A bad minimum does not stop the location: each tick (and each run, test_dagster_audit64) says what is wrong.
    for value in ("0", "2.5", "x"):
        schedule = schedules.daily_enrichment({"CONDUCTOR_ENRICH_MIN_PLANS": value})
        with DagsterInstance.ephemeral() as inst, pytest.raises(Exception) as e:
            schedule.evaluate_tick(build_schedule_context(instance=inst))
        assert f"CONDUCTOR_ENRICH_MIN_PLANS={value!r}: expected a whole number" in str(e.value.__cause__)
    with DagsterInstance.ephemeral() as inst:
        tick = schedules.daily_enrichment({"CONDUCTOR_ENRICH_MIN_PLANS": "3"}).evaluate_tick(
            build_schedule_context(instance=inst))
    assert tick.run_requests[0].run_config["ops"]["worker_stats"]["config"] == {"min_plans": 3}


def test_eval_report_defaults_live_under_the_data_dir(tmp_path, monkeypatch):
    """Pool, query set and report default to CONDUCTOR_DATA_DIR (the storage resource), not ./data."""
    from assets.evaluation import eval_report

    cwd, data = tmp_path / "cwd", tmp_path / "data"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    replay = tmp_path / "replay"
    replay.mkdir()
    with DagsterInstance.ephemeral() as inst:
        result = materialize([eval_report], instance=inst, resources={"storage": StorageResource(data_dir=str(data))},
                             run_config={"ops": {"eval_report": {"config": {"replay_dir": str(replay)}}}})
    skipped = result.output_for_node("eval_report")["skipped"]
    assert f"{data / 'pools' / 'replay-gsm8k.yaml'} and {data / 'replay' / 'gsm8k.parquet'} not found" in skipped
    if not (REPLAY / "gsm8k.parquet").exists():
        return
    config = {"replay_dir": str(REPLAY), "create_missing": True, "run_planner": False}
    with DagsterInstance.ephemeral() as inst:
        result = materialize([eval_report], instance=inst, resources={"storage": StorageResource(data_dir=str(data))},
                             run_config={"ops": {"eval_report": {"config": config}}})
    assert result.success
    assert (data / "eval" / "gsm8k-all" / "report.md").exists() and (data / "replay" / "gsm8k.parquet").exists()
    assert list(cwd.iterdir()) == []
