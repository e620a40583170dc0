"""The runs view's `settings` are what the run runs with now (review41 2): a run a budget stopped
has a summary with its old budget; rerun with a larger one and interrupted, the view showed the
summary's stale budget. Real runs against the simulated pool, one stopped by SIGINT (Ctrl-C)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import orjson
import pytest

from tests.conftest import REPO, cli, line_count, run_cli
from tests.test_catalog_stop39 import _slow_pool


def _interrupt_once_it_pays(args: list, steps) -> None:
    """`conductor ARGS` stopped by SIGINT once it has logged two steps more than `steps` held."""
    before = line_count(steps)
    p = subprocess.Popen([sys.executable, "-m", "conductor", *map(str, args)], cwd=REPO, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    deadline = time.monotonic() + 120
    while line_count(steps) < before + 2 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, f"the run ended before it was stopped: {p.stderr.read()}"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err


@pytest.mark.slow  # whole runs through the CLI, one stopped by Ctrl-C
def test_an_interrupted_rerun_shows_its_new_budget_not_the_old_summarys(tmp_path, fresh_sim, sample_queries):
    data, pool = tmp_path / "data", _slow_pool(tmp_path, fresh_sim)
    args = ["run", sample_queries, "--pool", pool, "--data-dir", data, "--run-id", "r", "--quiet", "--no-cache"]
    r = run_cli(*args, "--budget", "0.0002")
    assert r.returncode == 3, r.stdout + r.stderr  # stopped by the budget: a summary with budget 0.0002
    _interrupt_once_it_pays([*args, "--budget", "5"], data / "runs" / "r" / "work" / "steps.jsonl")
    manifest = orjson.loads((data / "runs" / "r" / "manifest.json").read_bytes())
    assert manifest["status"] == "interrupted" and manifest["summary"]["settings"]["budget_usd"] == 0.0002
    r = cli("sql", "SELECT settings FROM runs", "--data-dir", data, "--format", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    [row] = [orjson.loads(line) for line in r.stdout.splitlines()]
    assert row["settings"]["budget_usd"] == 5 and row["settings"] == manifest["settings"], row
