"""Audit 64 of the Dagster front end, as a user meets it:
- CONDUCTOR_ENRICH_MIN_PLANS applies to every run of enrich_catalog (the README's
  `dagster job execute`, a launch with the job's default config as the UI's
  launchpad makes), not only to the schedule's ticks, and a bad value fails each
  of those runs naming the variable (it was ignored: 0 ran, 1000 filtered nothing);
- a bad CONDUCTOR_ENRICH_JOBS_HOUR stops the code location from loading even
  when there are no job files (it loaded);
- every asset's `parquet_path` is absolute, query_set's too (it was relative to
  the code location's working directory)."""

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from dagster import DagsterInstance, build_schedule_context, materialize

from assets import resources
from pipelines.definitions import defs
from tests.conftest import REPO, write_pool
from tests.test_dagster import ASSETS, INSTANCE_YAML, add_partition, conductor_env, instance  # noqa: F401
from tests.test_dagster import small_queries
from tests.test_dagster_settings import failure_messages, load_location

# slow: real Dagster materializations and the dagster CLI in a subprocess
pytestmark = pytest.mark.slow

BAD_MIN_PLANS = "CONDUCTOR_ENRICH_MIN_PLANS={!r}: expected a whole number of plans, at least 1"


def some_runs(tmp_path: Path, instance: DagsterInstance, sim, sample_queries: Path) -> dict[str, str]:
    """One small partition materialized under tmp_path/data; the CONDUCTOR_* settings that find it."""
    env = conductor_env(tmp_path, write_pool(tmp_path / "pool.yaml", sim.url),
                        CONDUCTOR_JOBS_DIR=str(tmp_path / "no_jobs"))
    res = resources.from_env(env)
    add_partition(instance, res, "small", small_queries(tmp_path, sample_queries, 12))
    assert materialize(ASSETS, partition_key="small", instance=instance, resources=res).success
    return env


def worker_stats_rows(tmp_path: Path) -> list[dict]:
    return pq.read_table(tmp_path / "data" / "enrichment" / "worker_stats.parquet").to_pylist()


def approx_rows(rows: list[dict]) -> list:
    """The same rows: a sum of costs may differ in its last bit with the order it was added in."""
    return [pytest.approx(row) for row in rows]


def job_execute(env: dict[str, str]) -> subprocess.CompletedProcess:
    """The README's "run it now": `dagster job execute -m pipelines.definitions -j enrich_catalog`."""
    full = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **env}
    return subprocess.run([sys.executable, "-m", "dagster", "job", "execute", "-m", "pipelines.definitions",
                           "-j", "enrich_catalog"], cwd=REPO, env=full, capture_output=True, text=True, timeout=600)


def test_min_plans_applies_to_dagster_job_execute_and_a_bad_value_fails_it(tmp_path, instance, fresh_sim,
                                                                           sample_queries):
    env = some_runs(tmp_path, instance, fresh_sim, sample_queries)
    home = {"DAGSTER_HOME": os.environ["DAGSTER_HOME"]}  # the instance fixture's

    r = job_execute({**env, **home})
    assert r.returncode == 0, r.stdout + r.stderr
    every = worker_stats_rows(tmp_path)
    assert every and max(row["plans"] for row in every) < 1000

    r = job_execute({**env, **home, "CONDUCTOR_ENRICH_MIN_PLANS": "1000"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert worker_stats_rows(tmp_path) == []  # no worker/task pair was seen in 1000 plans

    (tmp_path / "data" / "enrichment" / "worker_stats.parquet").unlink()
    r = job_execute({**env, **home, "CONDUCTOR_ENRICH_MIN_PLANS": "0"})
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert BAD_MIN_PLANS.format("0") in out, out
    assert not (tmp_path / "data" / "enrichment" / "worker_stats.parquet").exists()


def test_min_plans_applies_to_a_launch_with_the_jobs_default_config(tmp_path, instance, fresh_sim, sample_queries):
    """The real enrich_catalog job launched with no run config, as the UI's launchpad does by default,
    with the resources the code location builds from the environment."""
    env = some_runs(tmp_path, instance, fresh_sim, sample_queries)
    job = defs.resolve_job_def("enrich_catalog")

    assert job.execute_in_process(instance=instance, resources=resources.from_env(env)).success
    every = worker_stats_rows(tmp_path)
    assert len(every) >= 2
    cut = sorted(row["plans"] for row in every)[-1]  # keeps only the pairs seen in the most plans
    kept = [row for row in every if row["plans"] >= cut]
    assert 0 < len(kept) < len(every)

    result = job.execute_in_process(
        instance=instance, resources=resources.from_env({**env, "CONDUCTOR_ENRICH_MIN_PLANS": str(cut)}))
    assert result.success
    assert worker_stats_rows(tmp_path) == approx_rows(kept)
    [mat] = result.get_asset_materialization_events()
    assert mat.materialization.metadata["min_plans"].value == cut

    # The schedule's tick asks for the same threshold.
    with_cut = {**env, "CONDUCTOR_ENRICH_MIN_PLANS": str(cut)}
    from pipelines import schedules
    tick = schedules.daily_enrichment(with_cut).evaluate_tick(build_schedule_context(instance=instance))
    assert job.execute_in_process(run_config=tick.run_requests[0].run_config, instance=instance,
                                  resources=resources.from_env(with_cut)).success
    assert worker_stats_rows(tmp_path) == approx_rows(kept)

    for bad in ("0", "2.5", "x"):
        result = job.execute_in_process(
            instance=instance, resources=resources.from_env({**env, "CONDUCTOR_ENRICH_MIN_PLANS": bad}),
            raise_on_error=False)
        assert not result.success and not result.get_asset_materialization_events()
        assert BAD_MIN_PLANS.format(bad) in failure_messages(result), bad


def test_a_bad_jobs_hour_stops_the_location_without_job_files(tmp_path):
    (tmp_path / "no_jobs").mkdir()
    for hour in ("25", "four"):
        r = load_location(tmp_path, CONDUCTOR_ENRICH_JOBS_HOUR=hour, CONDUCTOR_JOBS_DIR=str(tmp_path / "no_jobs"))
        out = r.stdout + r.stderr
        assert r.returncode != 0, out
        assert f"CONDUCTOR_ENRICH_JOBS_HOUR={hour!r}: expected an hour of the day (UTC), a whole number 0 to 23" \
               in out, out


def test_every_assets_parquet_path_is_absolute(tmp_path, instance, fresh_sim, sample_queries, monkeypatch):
    """With the default, relative, data folder (`data` under the working directory)."""
    monkeypatch.chdir(tmp_path)
    res = resources.from_env({"CONDUCTOR_POOL": str(write_pool(tmp_path / "pool.yaml", fresh_sim.url))})
    assert res["query_files"].store == "data/query_sets"
    add_partition(instance, res, "small", small_queries(tmp_path, sample_queries, 6))
    result = materialize(ASSETS, partition_key="small", instance=instance, resources=res)
    assert result.success
    paths = {e.asset_key.to_user_string(): e.materialization.metadata["parquet_path"].value
             for e in result.get_asset_materialization_events() if "parquet_path" in e.materialization.metadata}
    assert set(paths) == {"query_set", "plans", "executions", "rewards"}
    assert paths["query_set"] == str(tmp_path / "data" / "query_sets" / "small.parquet")
    for name, path in paths.items():
        assert Path(path).is_absolute() and Path(path).is_file(), (name, path)
