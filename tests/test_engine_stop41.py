"""The executor says what it did, as it did it (stop 41):

- a batch line answered online and then refused (enrichment: no valid record) is counted by the
  run's summary as by its closing line (review40b 6);
- a batch this run asked to cancel that ended `completed` is not said to be cancelled (review40b 11);
- a second Ctrl-C says how many calls in flight it cut off (audit67 F9);
- a work folder deleted mid-run stops the sending, and what was paid stays in the run's spend
  (audit67 F8);
- a wait for the shared governor is no retry on the progress line.

Real parts: `conductor run` as a user starts it (or run_all in process where a record check is
needed), the simulated LLM server and its Batch API over HTTP, a real redis-server."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from functools import partial

import orjson
import pyarrow.parquet as pq
import pytest

import conductor.runner
from conductor.runner import RunConfig, run_all
from tests.conftest import REPO, SAMPLE, run_cli, write_pool
from tests.test_batch import batch_pool
from tests.test_budget_governor_stop39 import setup, start_redis, wait_until
from tests.test_executor import FixedPlanner, solve

NOTE = "answered online at the online price: batch "
CLOSING = re.compile(r"^batch lines answered online at the online price: ([0-9,]+) ", re.M)


def queries(tmp_path, n):
    path = tmp_path / f"q{n}.parquet"
    pq.write_table(pq.read_table(SAMPLE).slice(0, n), path)
    return path


def start(tmp_path, *args, quiet=True):
    return subprocess.Popen([sys.executable, "-m", "conductor", "run", *map(str, args), "--data-dir",
                             str(tmp_path / "data"), *(["--quiet"] if quiet else [])], cwd=REPO,
                            env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def journal_lines(tmp_path, name="reservations.jsonl") -> int:
    found = list((tmp_path / "data").glob(f"runs/*/work/{name}"))
    return len(found[0].read_bytes().splitlines()) if found else 0


def manifest(tmp_path) -> dict:
    return orjson.loads(next((tmp_path / "data").glob("runs/*/manifest.json")).read_bytes())


def run_cap_spent(m: dict) -> float:
    return next(c["spent_usd"] for c in m["spend"] if c["cap"] == "run")


class NeverARecord:
    """An enrichment record check that takes no reply (as one whose schema the model misses)."""

    def check(self, text):
        return None, "not the record this job asks for"


def test_online_answers_refused_as_no_record_are_counted_in_the_summary_as_in_the_closing_line(
        tmp_path, fresh_sim, monkeypatch, caplog):
    """The closing line counted the batch lines answered online that the record check then refused;
    their rows lost the online note, so the summary's batch_online (read from the notes) did not."""
    from conductor.execute.structured import RecordSpec

    spec = RecordSpec("job", {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                              "additionalProperties": False}, NeverARecord())
    monkeypatch.setattr(conductor.runner, "execute_stage", partial(conductor.runner.execute_stage, record=spec))
    fresh_sim.set_faults(batch_fail_rate=1.0)  # every batch fails: its lines are answered online
    cfg = RunConfig(queries=queries(tmp_path, 4), pool=batch_pool(tmp_path / "pool.yaml", fresh_sim.url),
                    data_dir=tmp_path / "data", progress=False, run_id="rec", cache=False)
    with caplog.at_level(logging.WARNING, logger="conductor.batch"):
        summary = run_all(cfg, planner=FixedPlanner(solve("fast")))
    said = CLOSING.findall("\n".join(caplog.messages))
    assert len(said) == 1, caplog.messages
    online = fresh_sim.log()["by_status"]["200"]  # the first reply and its repair, per plan
    assert int(said[0].replace(",", "")) == online == 8
    assert summary["batch_online"]["lines"] == online, summary["batch_online"]
    traces = pq.read_table(tmp_path / "data" / "runs" / "rec" / "traces.parquet").to_pylist()
    refused = [t for t in traces if t["status"] == "invalid"]
    assert len(refused) == online
    for t in refused:  # the note, then why the answer was refused
        assert t["error"].startswith(NOTE) and t["error"].endswith("not the record this job asks for"), t["error"]


def test_a_batch_that_ends_completed_after_this_run_asked_to_cancel_it_is_not_said_cancelled(
        tmp_path, fresh_sim, monkeypatch, caplog):
    """The note said "batch X completed: cancelled by this run after batch_max_wait_s" from the moment
    the cancel was asked, though the provider then finished the batch (its lines' own errors stand)."""
    import litellm

    async def too_late(**kw):  # the provider takes the request, and finishes the batch all the same
        return None

    monkeypatch.setattr(litellm, "acancel_batch", too_late)
    fresh_sim.set_faults(batch_delay_s=2.5, batch_line_error_rate=1.0)
    pool = batch_pool(tmp_path / "pool.yaml", fresh_sim.url, batch_max_wait_s=1.0)
    cfg = RunConfig(queries=queries(tmp_path, 2), pool=pool, data_dir=tmp_path / "data", progress=False,
                    run_id="late", cache=False)
    with caplog.at_level(logging.WARNING, logger="conductor.batch"):
        run_all(cfg, planner=FixedPlanner(solve("fast")))
    traces = pq.read_table(tmp_path / "data" / "runs" / "late" / "traces.parquet").to_pylist()
    noted = [t["error"] for t in traces if (t["error"] or "").startswith(NOTE)]
    assert len(noted) == 2, [t["error"] for t in traces]
    for note in noted:
        assert re.match(r"answered online at the online price: batch \S+ completed: ", note), note
        assert "cancelled by this run" not in note, note
    closing = "\n".join(caplog.messages)
    assert "that answered them with an error" in closing and "cancelled" not in closing, closing


def test_a_second_ctrl_c_says_how_many_calls_in_flight_it_cut_off(tmp_path, fresh_sim):
    """Only the rerun's summary said it ("lost in flight 4 call(s)"); the stop said nothing of them."""
    fresh_sim.set_faults("slow", latency_ms=8000, latency_sd_ms=0)  # still in flight at both signals
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("slow",),
                      providers={"sim": {"max_concurrency": 4, "timeout_s": 30}})
    args = (queries(tmp_path, 8), "--pool", pool, "--no-cache")
    p = start(tmp_path, *args)
    try:
        wait_until(p, lambda: journal_lines(tmp_path) >= 4, "4 calls were sent")
        p.send_signal(signal.SIGINT)
        first = ""
        while "stopping: no new call is sent" not in first:  # the first signal was taken: its drain waits
            first = p.stderr.readline()
            assert first, "the run ended before it said it was stopping"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    in_flight = int(re.search(r"for (\d+) call\(s\) in flight", first).group(1))
    assert p.returncode == 130 and in_flight == 4, first + err
    cut = re.search(r"stopping now: (\d+) call\(s\) in flight cut off; the provider may bill them, and the rerun "
                    r"sends them again", err)
    assert cut and int(cut.group(1)) == in_flight, err
    fresh_sim.clear_faults()
    r = run_cli("run", *args, "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 0 and re.search(rf"lost in flight +{in_flight} call\(s\)", r.stdout), r.stdout + r.stderr


def _deleted_mid_run(tmp_path, fresh_sim, n: int, folder) -> tuple[tuple, subprocess.Popen, str]:
    """Run `gone` (n calls of 0.3 s, one at a time) and delete `folder` once 3 calls were sent:
    the run's arguments, its process (ended) and its stderr."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("slow",),
                      providers={"sim": {"max_concurrency": 1, "timeout_s": 10}})
    args = (queries(tmp_path, n), "--pool", pool, "--run-id", "gone")
    p = start(tmp_path, *args)
    try:
        wait_until(p, lambda: journal_lines(tmp_path) >= 3, "3 calls were sent")
        shutil.rmtree(folder)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    return args, p, err


def test_a_work_folder_deleted_mid_run_stops_the_sending_and_its_spend_is_kept(tmp_path, fresh_sim):
    """The run went on to send every call, then failed; the money it paid was in no journal, and the
    rerun, served from the shared cache for $0, left it in no run's spent_usd (audit67 F8)."""
    n = 24
    work = tmp_path / "data" / "runs" / "gone" / "work"
    args, p, err = _deleted_mid_run(tmp_path, fresh_sim, n, work)
    sent = fresh_sim.log()["total"]
    assert sent < n, f"every call was sent after the work folder was deleted: {sent}"
    assert p.returncode == 2 and f"the work folder {work} was deleted" in err, err
    m = manifest(tmp_path)
    assert m["status"] == "failed" and m["failed_in"] == "executing" and str(work) in m["error"]
    paid = run_cap_spent(m)
    assert paid > 0  # what it paid is in the run's spend (the runs view's spent_usd)

    r = run_cli("run", *args, "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    assert fresh_sim.log()["total"] == n  # the answers paid before came from the shared cache
    summary = orjson.loads((tmp_path / "data" / "runs" / "gone" / "summary.json").read_bytes())
    assert 0 < summary["cost_usd"] and run_cap_spent(manifest(tmp_path)) == pytest.approx(paid + summary["cost_usd"])


def test_a_run_folder_deleted_mid_run_is_said_not_a_traceback(tmp_path, fresh_sim):
    """review41 1: with the whole run folder gone, keeping the spend found no manifest, and the
    command ended in a FileNotFoundError traceback (exit 1) instead of its message (exit 2)."""
    folder = tmp_path / "data" / "runs" / "gone"
    _, p, err = _deleted_mid_run(tmp_path, fresh_sim, 24, folder)
    assert p.returncode == 2 and f"the work folder {folder / 'work'} was deleted" in err, err
    assert "Traceback" not in err and fresh_sim.log()["total"] < 24, err


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_calls_held_back_by_the_governor_are_no_retries_on_the_progress_line(tmp_path, fresh_sim):
    """A 3 s governor outage put "retries N" on the progress line, one per call it held back, though
    nothing was retried: the outage failed nothing and no request was sent twice."""
    server = start_redis()
    try:
        q, pool = setup(tmp_path, 40, server.url, fresh_sim.url, ("slow",))
        p = start(tmp_path, q, "--pool", pool, "--run-id", "gov", "--no-cache", quiet=False)
        wait_until(p, lambda: fresh_sim.log()["total"] >= 8, "8 calls were answered")
        server.kill()
        time.sleep(3.0)
        server.start()
        _, err = p.communicate(timeout=300)
    finally:
        server.stop()
    assert p.returncode == 0, err
    assert "shared governor" in err and "answers again" in err, err  # it was down, and held calls back
    assert max(fresh_sim.log()["by_request_key"].values()) == 1  # nothing sent twice
    last = re.findall(r"^\[execute\] plans 40/40 .*\bretries (\d+)\b", err, re.M)
    assert last and last[-1] == "0", err
