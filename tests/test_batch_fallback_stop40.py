"""Batch lines answered online at the online price are said, not paid for in silence: a run
whose batches all failed validation, or were cancelled at batch_max_wait_s, exited 0 with
nothing in its output, summary or traces to say that every line cost twice the batch price
(audit67 F2). Now one line at the end of the run counts them, with the batches' error, each
line's trace row says so in `error` (status `ok`), and the run's summary counts them.

Over real HTTP against the simulated server's Files and Batch API, as `conductor run` runs."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest

from tests.test_batch import batch_pool, queries, run  # noqa: F401 - queries: the module's fixture

ONLINE_LINE = re.compile(r"^batch lines answered online at the online price: ([0-9,]+) \(\$([0-9.]+)\), as their "
                         r"batches did not answer them: (.*)$", re.M)
NOTE = "answered online at the online price: batch "


def run_dir(data):
    return next((data / "runs").iterdir())


def said(stderr: str) -> tuple[int, float, str]:
    found = ONLINE_LINE.findall(stderr)
    assert len(found) == 1, stderr  # one line, at the end
    n, usd, why = found[0]
    return int(n.replace(",", "")), float(usd), why


def online_answers(traces) -> list[dict]:
    return [t for t in traces if t["status"] == "ok" and (t["error"] or "").startswith(NOTE)]


def test_lines_of_failed_batches_answered_online_are_said_with_the_batches_error(tmp_path, fresh_sim, queries):
    clean = run(queries, batch_pool(tmp_path / "pool.yaml", fresh_sim.url), tmp_path / "clean", "--no-cache")
    assert clean.returncode == 0 and not ONLINE_LINE.search(clean.stderr), clean.stderr  # nothing went online

    fresh_sim.reset()
    fresh_sim.set_faults(batch_fail_rate=1.0)  # every batch fails validation (as an enqueued-token limit does)
    done = run(queries, batch_pool(tmp_path / "pool.yaml", fresh_sim.url), tmp_path / "data", "--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr  # the answers are good
    log = fresh_sim.log()
    online = log["by_status"]["200"]
    assert online == log["total"] > 0 and log["batches_created"] >= 2

    n, usd, why = said(done.stderr)
    assert n == online
    batches = log["batches_created"]
    assert re.match(rf"{online} from {batches} batches that failed \(e\.g\. The batch failed validation", why), why
    assert "batch_retry: batch" in done.stderr

    out = run_dir(tmp_path / "data")
    traces = pq.read_table(out / "traces.parquet").to_pylist()
    results = pq.read_table(out / "results.parquet").to_pylist()
    assert {r["status"] for r in results} == {"ok"}
    noted = online_answers(traces)
    assert len(noted) == online and all("failed: The batch failed validation" in t["error"] for t in noted)
    assert usd == pytest.approx(sum(t["cost_usd"] for t in noted), abs=1e-6)

    # what the run's summary records, in summary.json and the manifest
    summary = json.loads((out / "summary.json").read_text())["batch_online"]
    assert json.loads((out / "manifest.json").read_text())["summary"]["batch_online"] == summary
    assert summary["lines"] == online and summary["batches"] == batches
    assert summary["by_end"]["failed"]["lines"] == online
    assert "The batch failed validation" in summary["by_end"]["failed"]["example"]
    assert summary["cost_usd"] == pytest.approx(sum(t["cost_usd"] for t in noted), rel=1e-9)


@pytest.mark.slow  # waits on the clock
def test_lines_of_a_batch_cancelled_at_batch_max_wait_s_answered_online_are_said(tmp_path, fresh_sim, queries):
    fresh_sim.set_faults(batch_delay_s=600)
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url, batch_max_wait_s=1.0)
    done = run(queries, pool, tmp_path / "data", "--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr
    log = fresh_sim.log()
    online = log["by_status"]["200"]
    assert online == log["batch_lines"]["batch_cancelled"] > 0

    n, _, why = said(done.stderr)
    assert n == online
    assert re.match(rf"{online} from [0-9]+ batch(es)? that (was|were) cancelled \(e\.g\. cancelled by this run "
                    rf"after batch_max_wait_s \(1 s\)\)", why), why
    traces = pq.read_table(run_dir(tmp_path / "data") / "traces.parquet").to_pylist()
    noted = online_answers(traces)
    assert len(noted) == online and all("cancelled by this run after batch_max_wait_s" in t["error"] for t in noted)
