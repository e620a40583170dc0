"""The Dagster UI, as a user sees it: `dagster dev` on a free port, one
query-set partition materialized with the CLI against the same instance, and
the lineage page in headless Chromium showing the assets, their latest
materialization and their checks. The screenshot is kept in artifacts/."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import DagsterInstance

from pipelines.jobs import PIPELINE
from tests import dagster_dev as dev
from tests.conftest import REPO, write_pool

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
ARTIFACTS = REPO / "artifacts"
CHECKS_SHOWN = {"plans": "2 / 2 Passed", "executions": "5 / 5 Passed", "rewards": "1 / 1 Passed"}

pytestmark = pytest.mark.slow


@pytest.fixture
def dagster_dev(tmp_path, monkeypatch, fresh_sim, sample_queries):
    """`dagster dev` in its own process group, on a temporary instance and data folder."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium and chromium-driver (make setup-test)")
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "data" / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    data = tmp_path / "data"
    (data / "query_sets").mkdir(parents=True)
    shutil.copy(sample_queries, data / "query_sets" / "mixed-60.parquet")
    env = {**os.environ, "DAGSTER_HOME": str(home), "CONDUCTOR_DATA_DIR": str(data),
           "CONDUCTOR_POOL": str(write_pool(tmp_path / "pool.yaml", fresh_sim.url)),
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONUNBUFFERED": "1"}
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # dagster.yaml reads it for its storage paths
    with DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("query_sets", ["mixed-60"])
    ARTIFACTS.mkdir(exist_ok=True)
    log = open(ARTIFACTS / "dagster_dev.log", "w")
    port = dev.free_port()
    before = set(REPO.glob(".tmp_dagster_home_*"))
    proc = dev.start(env, port, log)
    try:
        yield port, env
    finally:
        dev.stop(proc)
        log.close()
        assert set(REPO.glob(".tmp_dagster_home_*")) == before


def test_lineage_page_shows_the_materialized_partition_and_its_checks(dagster_dev):
    from playwright.sync_api import sync_playwright

    port, env = dagster_dev
    dev.wait_loaded(port, ARTIFACTS / "dagster_dev.log")

    # The README's rerun command, against the same instance the UI shows.
    run = subprocess.run(
        [sys.executable, "-m", "dagster", "asset", "materialize", "-m", dev.LOCATION,
         "--select", ",".join(PIPELINE), "--partition", "mixed-60"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "RUN_SUCCESS" in run.stdout + run.stderr

    assert dev.graphql(port, "mutation { setNuxSeen }")["data"]["setNuxSeen"] is True  # no first-visit dialog
    assert dev.graphql(port, "{ shouldShowNux }")["data"]["shouldShowNux"] is False
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1900, "height": 640}, device_scale_factor=2)
            page.add_init_script("window.localStorage.setItem('asset-graph-direction', '\"horizontal\"')")
            page.goto(f"http://127.0.0.1:{port}/locations/{dev.LOCATION}/asset-groups/conductor/lineage",
                      wait_until="networkidle", timeout=60_000)
            nodes = page.locator("foreignObject")
            page.wait_for_function(
                "names => names.every(n => [...document.querySelectorAll('foreignObject')]"
                ".some(e => e.textContent.startsWith(n) && e.textContent.includes('100% filled')))",
                arg=PIPELINE, timeout=60_000)
            page.wait_for_timeout(500)  # let the edges settle before the picture
            page.screenshot(path=str(ARTIFACTS / "dagster_ui_lineage.png"))
            texts = nodes.evaluate_all("els => els.map(e => e.textContent)")
            dialogs = page.get_by_text("Join the Dagster community").count()
        finally:
            browser.close()
    shown = {name: t for t in texts for name in PIPELINE + ["worker_stats"] if t.startswith(name + "Latest")}
    assert set(PIPELINE) <= set(shown)
    for name in PIPELINE:  # materialized just now: a latest event, and the partition filled
        assert "ago" in shown[name] and "100% filled" in shown[name] and "Never materialized" not in shown[name]
    for name, checks in CHECKS_SHOWN.items():
        assert checks in shown[name], shown[name]
    assert "Never materialized" in shown["worker_stats"]
    assert dialogs == 0
    assert (ARTIFACTS / "dagster_ui_lineage.png").stat().st_size > 10_000
