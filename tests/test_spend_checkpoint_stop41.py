"""A run's spend so far is in its manifest while it executes (stop 41). The runs view's
`spent_usd` was null for a run still executing, and for good for one killed outright before any
Ctrl-C, though its calls were paid: `SELECT sum(spent_usd) FROM runs` missed that money. A real
run against the simulated pool, killed with SIGKILL as an OOM killer or a lost node would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import orjson
import pytest

from tests.conftest import REPO, cli, line_count, run_cli, write_pool


def _run_cap(spend: list[dict] | None) -> float | None:
    return next((c["spent_usd"] for c in spend or () if c["cap"] == "run"), None)


def _spent_usd(data) -> dict:
    r = cli("sql", "SELECT run_id, status, spent_usd FROM runs", "--data-dir", data, "--format", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    return {row["run_id"]: row for row in map(orjson.loads, r.stdout.splitlines())}


@pytest.mark.slow  # a whole run through the CLI, killed mid-run, then resumed
def test_a_running_and_a_killed_runs_spend_is_in_the_runs_view(tmp_path, fresh_sim, sample_queries):
    data = tmp_path / "data"
    pool = write_pool(tmp_path / "slow.yaml", fresh_sim.url, names=("slow",), providers={"sim": {"max_concurrency": 1}})
    manifest = data / "runs" / "r" / "manifest.json"
    p = subprocess.Popen([sys.executable, "-m", "conductor", "run", str(sample_queries), "--pool", str(pool),
                          "--data-dir", str(data), "--run-id", "r", "--quiet", "--no-cache"],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    try:
        deadline = time.monotonic() + 120
        seen = None
        while p.poll() is None and time.monotonic() < deadline:
            if manifest.exists():
                m = orjson.loads(manifest.read_bytes())
                if m.get("status") == "executing" and (_run_cap(m.get("spend")) or 0) > 0:
                    seen = m
                    break
            time.sleep(0.2)
        assert p.poll() is None, f"the run ended before it was seen running: {p.stderr.read()}"
        assert seen is not None, "the manifest of the executing run never held its spend"
        # While it runs, the view shows what it has paid (null before)
        row = _spent_usd(data)["r"]
        assert row["status"] == "executing" and row["spent_usd"] > 0, row
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    paid_steps = line_count(data / "runs" / "r" / "work" / "steps.jsonl")
    killed = orjson.loads(manifest.read_bytes())
    assert killed["status"] == "executing" and paid_steps > 0
    row = _spent_usd(data)["r"]
    assert row["spent_usd"] == _run_cap(killed["spend"]) > 0, (row, killed["spend"])

    r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--run-id", "r", "--quiet", "--no-cache")
    assert r.returncode == 0, r.stdout + r.stderr
    done = orjson.loads(manifest.read_bytes())
    row = _spent_usd(data)["r"]
    # The resumed run counts what the killed one paid, and more: its view row is its summary's spend
    assert row["status"] == "complete" and row["spent_usd"] == _run_cap(done["summary"]["spend"]), row
    assert row["spent_usd"] >= _run_cap(killed["spend"])
