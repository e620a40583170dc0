"""The planning progress line after Ctrl-C: planning calls cut off were counted as planned, so it
said `plans 60/60` when 22 were (audit67 F6)."""

from __future__ import annotations

import re
import signal

from tests import plannersim
from tests.conftest import line_count
from tests.plannersim import psim, queries, sim  # noqa: F401  (shared fixtures)


def test_the_progress_line_after_ctrl_c_counts_only_the_plans_made(sim, tmp_path, queries):
    p, _, data = plannersim.slow_planning(sim, tmp_path, queries)
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
