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
