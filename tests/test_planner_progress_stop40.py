"""The planning progress line after Ctrl-C: planning calls cut off were counted as planned, so it
said `plans 60/60` when 22 were (audit67 F6)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from tests import plannersim
from tests.conftest import REPO, line_count
from tests.plannersim import psim, queries, sim  # noqa: F401  (shared fixtures)


def test_the_progress_line_after_ctrl_c_counts_only_the_plans_made(sim, tmp_path, queries):
    sim.reset()
    sim.set_faults("sim-planner", latency_ms=1500, latency_sd_ms=0)
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=plannersim.planner_worker(sim.url),
                                providers={"sim": {"max_concurrency": 4}})
    data = tmp_path / "data"
    args = ["run", str(queries), "--pool", str(pool), "--planner", "llm", "--samples", "3",
            "--planner-option", "worker=conductor", "--no-cache", "--data-dir", str(data)]
    p = subprocess.Popen([sys.executable, "-m", "conductor", *args], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(line_count(j) >= 4 for j in data.glob("runs/*/work/planner/"
                                                                                           "steps.jsonl")):
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGINT)  # a second Ctrl-C: the calls in flight are cut off, not awaited
    _, err = p.communicate(timeout=60)
    sim.clear_faults()
    assert p.returncode == 130, err
    (journal,) = data.glob("runs/*/work/planner/steps.jsonl")
    made = line_count(journal)
    shown = [(int(a), int(b)) for a, b in re.findall(r"\[plan\] plans (\d+)/(\d+)", err)]
    assert shown, err
    assert shown[-1] == (made, 36) and made < 36, (shown, made, err)
