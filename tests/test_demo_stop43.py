"""`make demo` exits as `conductor run` does (audit78 F1-F3). It printed "accuracy 0.000"
and exited 0 when every plan failed, dropped the run's notes and failure table, and on
SIGTERM died by the signal, leaving the run `executing`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import REPO, SAMPLE, line_count

pytestmark = pytest.mark.slow  # each test runs the demo in its own process


def _demo(tmp_path: Path, pool: Path, queries: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "conductor.demo", "--port", "0", "--pool", str(pool), "--queries", str(queries),
         "--data-dir", str(tmp_path / "data")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})


def _queries(tmp_path: Path, n: int) -> Path:
    out = tmp_path / f"q{n}.parquet"
    pq.write_table(pq.read_table(SAMPLE).slice(0, n), out)
    return out


def _pool(tmp_path: Path, **faults) -> Path:
    pool = yaml.safe_load((REPO / "data" / "pools" / "sim.yaml").read_text())
    for w in pool["workers"]:
        w.setdefault("simulate", {}).update(faults)
    out = tmp_path / "pool.yaml"
    out.write_text(yaml.safe_dump(pool))
    return out


def test_a_demo_whose_plans_all_fail_exits_4_and_says_why(tmp_path):
    proc = _demo(tmp_path, _pool(tmp_path, fail_status=404), _queries(tmp_path, 8))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 4, out + err
    assert "Traceback" not in err, err
    assert "8 of 8 plans failed" in err, err
    assert "failures by worker and kind" in out, out
    assert "404" in out, out
    table = out.split("Accuracy and cost per task (conductor sql):", 1)[1]  # the SQL still shows the run
    assert "SQL error" not in err and "math" in table and "0.0" in table, out + err


def test_a_demo_terminated_mid_run_exits_143_and_leaves_the_run_resumable(tmp_path):
    slow = _pool(tmp_path, latency_ms={"mean": 1500, "sd": 10})
    proc = _demo(tmp_path, slow, _queries(tmp_path, 40))
    runs, deadline = tmp_path / "data" / "runs", time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        started = [d for d in runs.iterdir()] if runs.exists() else []
        if started and line_count(started[0] / "work" / "steps.jsonl") >= 1:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the demo ended before any step was journaled"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, out + err
    assert "Traceback" not in err, err
    assert "rerun" in err.lower(), err
    manifest = json.loads((started[0] / "manifest.json").read_text())
    assert manifest["status"] == "interrupted", manifest["status"]
