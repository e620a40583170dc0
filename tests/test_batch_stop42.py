"""What a run says when its batches end badly, or when a budget stops plans beside failures
(audit76 F4-F6), over real HTTP against the simulated server's Files and Batch API.

- A batch whose output file cannot be downloaded is charged to the budget at its lines' worst
  case (the provider may have run and billed it), and its lines are answered again online: the
  summary's `lost_in_flight` counted none of them, so nothing explained the budget above the
  cost, and nothing said the lines may have been paid twice.
- The example of an "expired" group named a line that answered HTTP 500, not the expiry.
- Exit 4 with plans also stopped by a budget named only the failures on its final line."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
import yaml

from tests.conftest import kill_when_journaled, run_cli, worker
from tests.test_batch import batch_pool, queries, run, tables  # noqa: F401 - queries: the module's fixture
from tests.test_batch_fallback_stop40 import online_answers, run_dir, said


def _api(url: str, method: str = "GET") -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30) as r:
        return json.loads(r.read())


def _summary(data) -> dict:
    return json.loads((run_dir(data) / "summary.json").read_text())


@pytest.mark.slow  # waits for a batch on the clock
@pytest.mark.parametrize("budget", [{"budget_usd": 1.0}, {}], ids=["budget", "no budget"])
def test_a_completed_batch_whose_output_cannot_be_downloaded_is_lost_in_flight_and_said_maybe_billed_twice(
        tmp_path, fresh_sim, queries, budget):
    fresh_sim.set_faults(batch_delay_s=2.0)
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url, **budget)
    args = ["run", str(queries), "--pool", str(pool), "--quiet", "--no-cache"]
    killed = kill_when_journaled(args, tmp_path / "data", 2, journal="work/batches.jsonl")
    assert killed is not None, "the run ended before it submitted a batch"
    bid = json.loads((killed / "work" / "batches.jsonl").read_text().splitlines()[1])["batch_id"]
    deadline = time.monotonic() + 60
    while (batch := _api(f"{fresh_sim.url}/batches/{bid}"))["status"] != "completed":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    _api(f"{fresh_sim.url}/files/{batch['output_file_id']}", "DELETE")  # as a provider's file that expired
    fresh_sim.reset()

    done = run_cli(*args, "--data-dir", tmp_path / "data")
    assert done.returncode == 0, done.stdout + done.stderr
    traces, results = tables(tmp_path / "data")
    assert {r["status"] for r in results} == {"ok"}
    lines = batch["request_counts"]["total"]
    online = online_answers(traces)
    assert len(online) == lines == fresh_sim.log()["by_status"]["200"]  # every line of it, paid again online

    n, _, why = said(done.stderr)
    assert n == lines
    assert re.search(rf"{lines} from 1 batch that could not be checked \(e\.g\. could not download file .*\): the "
                     rf"provider may have billed them in the batch too", why), why

    summary = _summary(tmp_path / "data")
    lost = summary["lost_in_flight"]
    assert lost["calls"] == lines and lost["reserved_usd"] > 0
    assert "lost in flight" in done.stdout and f"{lines} call(s) sent whose answers never came back" in done.stdout
    if not budget:
        return
    # what explains the provider's cap above the run's cost: those lines, at their worst case
    spent = {s["cap"]: s["spent_usd"] for s in summary["spend"]}["provider sim"]
    cost = sum(r["cost_usd"] for r in results)
    assert spent == pytest.approx(cost + lost["reserved_usd"], abs=2e-6)  # spent_usd is rounded


@pytest.mark.slow  # waits for batches on the clock
def test_the_example_of_an_expired_group_is_a_line_the_expiry_left_undone(tmp_path, fresh_sim, queries):
    # The batch answers its first half, every line of it with an error; the expiry leaves the rest
    fresh_sim.set_faults(batch_expire=0.5, batch_line_error_rate=1.0)
    done = run(queries, batch_pool(tmp_path / "pool.yaml", fresh_sim.url), tmp_path / "data", "--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr
    log = fresh_sim.log()
    assert log["batch_lines"].get("500", 0) > 0 and log["batch_lines"].get("batch_expired", 0) > 0

    n, _, why = said(done.stderr)
    assert n == log["by_status"]["200"]
    assert re.search(r"from [0-9]+ batch(es)? that expired \(e\.g\. batch_expired \(in a batch\)", why), why
    by_end = _summary(tmp_path / "data")["batch_online"]["by_end"]
    assert by_end["expired"]["example"].startswith("batch_expired (in a batch)"), by_end
    assert by_end["expired"]["lines"] == n  # the 500 lines of an expired batch count in its group all the same


def _split_pool(path, url):
    """`weak` (each plan's check, after `fast`) on a provider that answers 503, tried once; `fast` on one
    whose budget runs out after a few calls: plans stopped by it never get to `weak`, the others fail."""
    doc = {"providers": {"poor": {"max_concurrency": 8, "timeout_s": 10, "budget_usd": 0.001},
                         "down": {"max_concurrency": 8, "timeout_s": 10, "max_attempts": 1}},
           "workers": [worker("fast", url, provider="poor"), worker("weak", url, provider="down")]}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_exit_4_with_plans_also_stopped_by_a_budget_says_so_on_its_final_line(tmp_path, fresh_sim, queries):
    fresh_sim.set_faults(model="weak", fail_status=503, retry_after_ms=0)
    done = run(queries, _split_pool(tmp_path / "pool.yaml", fresh_sim.url), tmp_path / "data", "--no-cache")
    assert done.returncode == 4, done.stdout + done.stderr
    statuses = _summary(tmp_path / "data")["statuses"]
    stopped = statuses.get("budget_exhausted", 0)
    assert stopped > 0 and statuses.get("error", 0) > 1, statuses
    final = done.stderr.strip().splitlines()[-1]
    assert re.match(rf"conductor: [0-9]+ of 20 plans failed \([0-9.]+%, more than 5\.0%\); {stopped} more were "
                    rf"stopped by a budget: raise it too", final), final
