"""The Dagster front end's CONDUCTOR_* settings, as a user meets them: a bad value is
refused with the variable, its value and what it takes; it stops the code location only
when the definitions need it (the enrichment start day), and otherwise fails the run that
uses it at its start, before a run folder, a concurrency pool or a call is made for it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import DagsterInstance, materialize

from assets import checks, resources
from tests.conftest import REPO, write_pool
from tests.test_dagster import ASSETS, INSTANCE_YAML, add_partition, conductor_env, instance  # noqa: F401
from tests.test_dagster import small_queries

# slow: real Dagster materializations and the code location loaded in a subprocess
pytestmark = pytest.mark.slow


def load_location(home: Path, **env: str) -> subprocess.CompletedProcess:
    """`dagster definitions validate` on the code location, as `dagster dev` would load it."""
    shutil.copy(INSTANCE_YAML, home / "dagster.yaml")
    full = {**os.environ, "DAGSTER_HOME": str(home), "LITELLM_LOCAL_MODEL_COST_MAP": "True", **env}
    return subprocess.run([sys.executable, "-m", "dagster", "definitions", "validate", "-m", "pipelines.definitions"],
                          cwd=REPO, env=full, capture_output=True, text=True, timeout=300)


def failure_messages(result) -> str:
    """The errors of the run's failed steps and resources, as the UI shows them."""
    return "\n".join(e.event_specific_data.error.to_string() for e in result.all_events
                     if e.event_type_value in ("STEP_FAILURE", "RESOURCE_INIT_FAILURE"))


def test_a_bad_enrich_start_stops_the_location_naming_the_variable(tmp_path):
    """Dagster's own error was `time data 'garbage' does not match format`, naming no variable."""
    r = load_location(tmp_path, CONDUCTOR_ENRICH_START="garbage")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "CONDUCTOR_ENRICH_START='garbage': expected the first day of the daily enrichment partitions as a " \
           "date YYYY-MM-DD, such as 2026-01-01" in out, out
    for bad in ("2026-02-30", ""):
        with pytest.raises(Exception, match=f"CONDUCTOR_ENRICH_START={bad!r}: expected"):
            resources.check_enrich_start({"CONDUCTOR_ENRICH_START": bad})
    resources.check_enrich_start({"CONDUCTOR_ENRICH_START": "2026-03-01"})


@pytest.mark.parametrize("env, message", [
    ({"CONDUCTOR_PLANNER": "bogus"}, "CONDUCTOR_PLANNER='bogus' (the planner resource's kind): expected one of "
                                     "embedded, vllm, llm"),
    ({"CONDUCTOR_PLANNER_MODEL": "foo"}, "CONDUCTOR_PLANNER_MODEL='foo' (the planner resource's model) needs "
                                         "CONDUCTOR_PLANNER=vllm or CONDUCTOR_PLANNER=llm"),
    ({"CONDUCTOR_PLANNER": "vllm"}, "CONDUCTOR_PLANNER='vllm' (the planner resource's kind) needs "
                                    "CONDUCTOR_PLANNER_MODEL"),
], ids=["unknown-planner", "model-with-embedded", "vllm-without-model"])
def test_a_planner_setting_that_cannot_work_fails_the_run_before_any_pool_or_call(
        tmp_path, instance, fresh_sim, sample_queries, env, message):
    """`planner-bogus` stayed in the instance's concurrency pools for good, and a model with the
    embedded planner was reported as an unknown option "model" nobody had set."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    res = resources.from_env(conductor_env(tmp_path, pool, **env))
    add_partition(instance, res, "small", small_queries(tmp_path, sample_queries, 6))
    result = materialize(ASSETS + checks.ALL, partition_key="small", instance=instance, resources=res,
                         raise_on_error=False)
    errors = failure_messages(result)
    assert not result.success and message in errors, errors
    assert "unknown option" not in errors
    assert not result.get_asset_materialization_events()  # refused in query_set: no run folder
    assert not (tmp_path / "data" / "runs").exists()
    assert not [p.name for p in instance.event_log_storage.get_pool_limits() if p.name.startswith("planner-")]
    assert fresh_sim.log()["total"] == 0


def unwritable_folders(tmp_path: Path) -> list[str]:
    """Folders no process can create: under a regular file, and in /proc (the audit's case)."""
    (tmp_path / "a_file").write_text("not a folder")
    return [str(tmp_path / "a_file" / "io")] + (["/proc/x"] if Path("/proc/self").exists() else [])


def test_an_io_dir_is_tried_when_the_run_starts(tmp_path, fresh_sim, sample_queries):
    """A folder that cannot be created or written: the run started, made its run folder in
    query_set, then failed writing the step's output with a bare FileNotFoundError naming no
    variable. Now it fails at its start, naming it; a folder that does not exist yet is made."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    for folder in unwritable_folders(tmp_path):
        result = materialize_with_io_dir(tmp_path, pool, sample_queries, folder)
        errors = failure_messages(result)
        assert not result.success and not result.get_asset_materialization_events()
        assert [e.event_type_value for e in result.all_events if "FAILURE" in e.event_type_value][0] == \
            "RESOURCE_INIT_FAILURE"
        assert f"CONDUCTOR_IO_DIR={folder!r}: cannot create or write the folder" in errors, errors
        assert "expected a folder this process can create and write" in errors
        assert not (tmp_path / "data" / "runs").exists()
    assert fresh_sim.log()["total"] == 0

    io_dir = tmp_path / "shared" / "dagster_io"
    assert materialize_with_io_dir(tmp_path, pool, sample_queries, str(io_dir)).success
    assert (io_dir / "query_set" / "small").is_file()
    assert not list(io_dir.glob("tmp*"))  # the probe leaves nothing behind


def materialize_with_io_dir(tmp_path: Path, pool: Path, sample_queries: Path, folder: str):
    """query_set alone (it writes the first value between steps) with CONDUCTOR_IO_DIR=folder."""
    res = resources.from_env(conductor_env(tmp_path, pool, CONDUCTOR_IO_DIR=folder))
    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "small", small_queries(tmp_path, sample_queries, 6))
        return materialize(ASSETS, selection=["query_set"], partition_key="small", instance=inst, resources=res,
                           raise_on_error=False)
