"""The progress display of long runs: an estimate only once there is a rate to go by,
a rate of this process's own plans (not those a resumed run finished before), and a
line for each stage that has no counter."""

from __future__ import annotations

import io
import time

from conductor.progress import Progress


def _progress(done: int, total: int, resumed: int = 0, elapsed: float = 10.0) -> str:
    p = Progress(stream=io.StringIO())
    p.c.plans_total, p.c.plans_done, p.c.plans_resumed = total, done, resumed
    p.c.started = time.monotonic() - elapsed
    return p.line()


def test_the_estimate_waits_for_a_rate():
    assert _progress(1, 400_000, elapsed=0.5).endswith("left ?")  # it said "left 7h31m"
    assert _progress(1_000, 400_000, elapsed=0.5).endswith("left ?")
    assert _progress(1_000, 11_000, elapsed=10).endswith("left 1m40s")


def test_a_resumed_run_estimates_from_the_plans_it_finished_itself():
    """It counted the plans finished before the kill: 'left 0s' with 48,250 to go."""
    assert _progress(51_750, 100_000, resumed=51_000, elapsed=10).endswith("left 10m43s")


def test_stages_without_counters_print_a_line_in_logs():
    out = io.StringIO()
    Progress(label="job", stream=out).say("writing records")
    Progress(label="job", stream=out, enabled=False).say("not shown")
    assert out.getvalue() == "[job] writing records\n"


def test_plans_a_budget_stopped_are_not_counted_as_errors(tmp_path, fresh_sim, sample_queries):
    """A budget stop is finished by the rerun; the progress line counted it among the errors,
    which sent users looking for a failing provider."""
    from tests.conftest import run_cli, write_pool

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--budget", "0.0005",
                "--no-cache")
    assert r.returncode == 3 and "budget_exhausted" in r.stdout, r.stdout + r.stderr
    last = [line for line in r.stderr.splitlines() if "] plans " in line][-1]
    assert "errors 0 " in last, last
