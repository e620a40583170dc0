"""Audit 60 (the README's enrichment jobs): a planned row a budget stopped, or whose step failed,
paid again for its answered steps on the rerun; a judge on a plain-text job was accepted and never
ran; a CSV column used in arithmetic through `set` or `for` went out as repeated text; editing a
worker a direct-mode job does not use recomputed every row (and, after a kill, editing a price in
the pool stopped the rerun); direct mode ignored a `planner:` block; the judge's runs had no
summary in the `runs` view. Counted at the simulated pool over HTTP."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.enrich import load_job
from conductor.enrich.run import run_job
from conductor.errors import InputError
from tests.conftest import REPO, cli, kill_when_journaled, line_count, worker

FREE = {"input_per_mtok": 0, "output_per_mtok": 0}


def write_input(folder: Path, n: int = 8) -> None:
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(n)],
                             "text": [f"Invoice {i}: {100 + i} units of part P{i}." for i in range(n)]}),
                   folder / "input.parquet")


def pool_doc(url: str, workers: list[dict], concurrency: int = 32) -> dict:
    return {"providers": {"sim": {"max_concurrency": concurrency, "timeout_s": 10}}, "workers": workers}


def job_doc(**changes) -> dict:
    doc = {"name": "docs", "input": {"path": "input.parquet", "id": "id"}, "prompt": "Note: {{ text }}",
           "fields": {"part": {"type": "string", "required": True}, "units": {"type": "number"}},
           "pool": "pool.yaml", "mode": "direct", "worker": "fast"}
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not None}


def write(folder: Path, name: str, doc: dict) -> Path:
    (folder / name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder / name


def records(summary: dict) -> dict[str, dict]:
    return {r["id"]: r for r in pq.read_table(summary["records_path"]).to_pylist()}


# ---- F1: a rerun after a budget stop or a failed step pays only for the steps never answered ----

def planned_job(folder: Path, url: str, budget_usd: float | None) -> Path:
    """Two free extractors (fast, weak) and a paid reconciler (flaky), one call at a time."""
    write_input(folder)
    write(folder, "pool.yaml", pool_doc(url, [
        worker("fast", url, price=FREE, params={"temperature": 0, "max_tokens": 64}),
        worker("weak", url, price=FREE, params={"temperature": 0, "max_tokens": 64}),
        worker("flaky", url, params={"temperature": 0, "max_tokens": 64})], concurrency=1))
    return write(folder, "job.yaml", job_doc(
        mode="planned", worker=None, budget_usd=budget_usd,
        planner={"name": "embedded", "policy": "none", "action": "ensemble:fast+weak>flaky"}))


def test_a_rerun_after_a_budget_stop_sends_only_the_steps_not_yet_answered(fresh_sim, tmp_path):
    """The rows a budget stopped at their reconciler had both extractors answered and in the
    response cache: the rerun with a raised budget sent and paid those two again per row."""
    sim, data = fresh_sim, tmp_path / "data"
    # the extractors are free, so the budget stops reconcilers only: a few fit, the rest are stopped
    first = run_job(load_job(planned_job(tmp_path, sim.url, budget_usd=0.0012)), data_dir=data, progress=False)
    stopped = first["statuses"].get("budget_exhausted", 0)
    assert 0 < stopped < 8 and first["exit_code"] == 3, first["statuses"]
    assert sim.log()["by_model"] == {"fast": 8, "weak": 8, "flaky": 8 - stopped}
    stopped_ids = {k for k, r in records(first).items() if r["status"] == "budget_exhausted"}

    sim.reset()
    again = run_job(load_job(planned_job(tmp_path, sim.url, budget_usd=1.0)), data_dir=data, progress=False)
    assert again["computed"] == stopped and again["reused"] == 8 - stopped
    assert sim.log()["by_model"] == {"flaky": stopped}  # the extractors' answers came from the cache
    assert again["calls"] == stopped and again["exit_code"] == 0
    rec = records(again)
    assert all(r["status"] == "ok" for r in rec.values())
    assert {k for k, r in rec.items() if not r["reused"]} == stopped_ids
    # the rows get the same confidences as a run that was never stopped: both extractors witnessed
    assert all(rec[k]["part_confidence"] is not None for k in stopped_ids)


def test_a_rerun_after_a_failed_step_sends_only_that_step(fresh_sim, tmp_path):
    """A row whose reconciler call failed (`error`) had its extractors paid again by the rerun."""
    sim, data = fresh_sim, tmp_path / "data"
    path = planned_job(tmp_path, sim.url, budget_usd=None)
    sim.set_faults("flaky", fail_status=400)
    first = run_job(load_job(path), data_dir=data, progress=False)
    assert first["statuses"] == {"error": 8}
    assert sim.log()["by_model"] == {"fast": 8, "weak": 8, "flaky": 8}
    sim.clear_faults()
    sim.reset()
    again = run_job(load_job(path), data_dir=data, progress=False)
    assert again["statuses"] == {"ok": 8} and again["computed"] == 8
    assert sim.log()["by_model"] == {"flaky": 8}
    assert again["calls"] == 8


# ---- F3: a judge on a plain-text job judges its replies -------------------------------------

def test_a_plain_text_job_with_a_judge_gets_its_replies_judged(fresh_sim, tmp_path):
    sim, data = fresh_sim, tmp_path / "data"
    write_input(tmp_path)
    write(tmp_path, "pool.yaml", pool_doc(sim.url, [worker("fast", sim.url), worker("weak", sim.url)]))
    path = write(tmp_path, "job.yaml", job_doc(
        fields=None, prompt="Summarize in one sentence: {{ text }}",
        quality={"judge": {"worker": "weak", "rubric": "A good summary is short and faithful."}}))
    r = cli("job", "check", path)
    assert r.returncode == 0, r.stderr
    s = run_job(load_job(path), data_dir=data, progress=False)
    assert sim.log()["by_model"] == {"fast": 8, "weak": 8}
    rec = records(s)
    assert all(r["status"] == "ok" and r["text"] for r in rec.values())
    assert all(r["judge_score"] is not None and 0 <= r["judge_score"] <= 1 and r["judge_reason"] and r["judge_hash"]
               for r in rec.values())
    assert s["judge_cost_usd"] > 0 and s["metrics"]["judge"]["judged_rows"] == 8
    # the judge saw the reply itself, as the records hold it
    jq = pq.read_table(data / "runs" / f"{s['run_id']}-judge" / "queries.parquet").to_pylist()
    assert all(f"The reply:\n{rec[q['query_id']]['text']}\n" in q["prompt"] for q in jq)
    # an unchanged rerun sends nothing; a new rubric rejudges without extracting
    sim.reset()
    same = run_job(load_job(path), data_dir=data, progress=False)
    assert sim.log()["total"] == 0 and same["reused"] == 8
    doc = yaml.safe_load(path.read_text())
    doc["quality"]["judge"]["rubric"] = "Strict: every number must be in the summary."
    write(tmp_path, "job.yaml", doc)
    sim.reset()
    new = run_job(load_job(path), data_dir=data, progress=False)
    assert sim.log()["by_model"] == {"weak": 8} and new["computed"] == 0


# ---- F4: CSV text in arithmetic through a name that holds it ---------------------------------

CSV_JOB = """\
name: b
input: {path: rev.csv, id: id}
prompt: |
  Review: {{ body }}
  LINE
pool: pool.yaml
mode: direct
worker: fast
"""


@pytest.mark.parametrize("line, said", [
    ("{% set a = amount %}{{ a * 2 }}", "column 'amount' (read as 'a') is in arithmetic"),
    ("{% for x in [amount, qty] %}{{ x * 2 }}{% endfor %}", "column 'amount' (read as 'x') is in arithmetic"),
    ("{% set a = amount %}{% set b = a %}{{ b * 3 }}", "column 'amount' (read as 'b') is in arithmetic"),
    ("{% with q = qty %}{% if q == 0 %}none{% endif %}{% endwith %}",
     "column 'qty' (read as 'q') is compared as a number"),
    ("{% set xs = [amount, qty] %}{{ xs | max }}", "column 'amount' (read as 'xs') is ordered with `max`"),
    ("{% macro twice(v) %}{{ v * 2 }}{% endmacro %}{{ twice(amount) }}",
     "column 'amount' (read as 'v') is in arithmetic"),
    ("{{ (amount | trim) * 2 }}", "column 'amount' is in arithmetic"),
])
def test_csv_text_in_arithmetic_through_a_name_is_refused_at_its_line(tmp_path, line, said):
    """`{% set a = amount %}{{ a * 2 }}` sent '1.501.50': only a bare column was refused."""
    (tmp_path / "rev.csv").write_text("id,body,amount,qty\n1,good,1.50,3\n2,bad,2.50,0\n")
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump({"workers": [
        {"id": "fast", "model": "openai/fast", "api_base": "http://127.0.0.1:1/v1"}]}))
    path = tmp_path / "job.yaml"
    path.write_text(CSV_JOB.replace("LINE", line))
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert f"job.yaml:5: prompt: {said}, but a CSV input is read as text" in r.stderr, r.stderr
    # converted where it is bound, the same template is accepted
    fixed = line.replace("= amount", "= amount | float").replace("[amount, qty]", "[amount | float, qty | int]") \
        .replace("= qty", "= qty | int").replace("twice(amount)", "twice(amount | float)") \
        .replace("(amount | trim)", "(amount | float)")
    path.write_text(CSV_JOB.replace("LINE", fixed))
    assert load_job(path).name == "b"


# ---- F5: a direct-mode job's rows depend on its own worker, not on the others in the pool ----

def test_editing_a_worker_a_direct_job_does_not_use_recomputes_nothing(fresh_sim, tmp_path):
    sim, data = fresh_sim, tmp_path / "data"
    write_input(tmp_path)
    workers = [worker("fast", sim.url), worker("weak", sim.url)]
    write(tmp_path, "pool.yaml", pool_doc(sim.url, workers))
    path = write(tmp_path, "job.yaml", job_doc())
    first = run_job(load_job(path), data_dir=data, progress=False)
    assert first["computed"] == 8
    other = copy.deepcopy(workers)
    other[1]["params"]["temperature"] = 0.3  # `weak`: not the job's worker
    other[1]["api_base"] = sim.url.replace("127.0.0.1", "localhost")
    write(tmp_path, "pool.yaml", pool_doc(sim.url, other))
    sim.reset()
    again = run_job(load_job(path), data_dir=data, progress=False)
    assert again["computed"] == 0 and again["reused"] == 8 and sim.log()["total"] == 0
    assert all(r["reused"] and r["run_id"] == first["run_id"] for r in records(again).values())
    # its own worker's parameters still decide its rows
    mine = copy.deepcopy(other)
    mine[0]["params"]["temperature"] = 0.5
    write(tmp_path, "pool.yaml", pool_doc(sim.url, mine))
    sim.reset()
    third = run_job(load_job(path), data_dir=data, progress=False)
    assert third["computed"] == 8 and sim.log()["by_model"] == {"fast": 8}


def test_a_killed_direct_job_reruns_after_a_price_edit_elsewhere_in_the_pool(fresh_sim, tmp_path):
    """The rerun of a killed job resumed its run under the runner, which refused it once the pool
    file's prices or descriptions had changed ("already exists with other inputs or settings"):
    the same command failed until the user thought of --run-id. It now starts a new run, closes
    the killed one as abandoned, and the answers paid there come from the response cache."""
    sim, data = fresh_sim, tmp_path / "data"
    write_input(tmp_path, n=40)
    workers = [worker("fast", sim.url), worker("weak", sim.url)]
    write(tmp_path, "pool.yaml", pool_doc(sim.url, workers, concurrency=2))
    path = write(tmp_path, "job.yaml", job_doc())
    sim.set_faults("*", latency_ms=100, latency_sd_ms=0)
    killed = kill_when_journaled(["job", "run", path, "--quiet"], data, lines=6)
    assert killed is not None
    sim.clear_faults()
    edited = copy.deepcopy(workers)
    edited[1]["price"] = {"input_per_mtok": 3.0, "output_per_mtok": 6.0}  # `weak`: not the job's worker
    write(tmp_path, "pool.yaml", pool_doc(sim.url, edited, concurrency=2))
    sim.reset()
    r = subprocess.run([sys.executable, "-m", "conductor", "job", "run", str(path), "--quiet", "--data-dir",
                        str(data)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "abandoned" in r.stdout and "already exists" not in r.stderr
    assert sim.log()["total"] <= 40 - 6  # the 6 steps the killed run had answered came from the cache


# ---- F6: direct mode refuses planned-mode keys -------------------------------------------------

@pytest.mark.parametrize("extra, key, needle", [
    ({"planner": {"name": "embedded", "polcy": "none", "action": "ensemble:fast+weak>fast"}}, "planner", "planner:"),
    ({"max_steps": 8}, "max_steps", "max_steps:"),
    ({"seed": 7}, "seed", "seed:"),
])
def test_direct_mode_refuses_planner_max_steps_and_seed_at_their_line(tmp_path, extra, key, needle):
    write_input(tmp_path)
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump({"workers": [
        {"id": "fast", "model": "openai/fast", "api_base": "http://127.0.0.1:1/v1"}]}))
    path = write(tmp_path, "job.yaml", job_doc(**extra))
    text = path.read_text()
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.startswith(needle))
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert f"job.yaml:{line}: {key}: only planned mode takes " in r.stderr, r.stderr
    with pytest.raises(InputError, match=f"{key}: only planned mode takes"):
        load_job(path)
    # in planned mode the same keys are taken (with the planner's options spelled right)
    planned = job_doc(**{**extra, "planner": {"name": "embedded", "policy": "none"}}, mode="planned", worker=None)
    assert load_job(write(tmp_path, "job.yaml", planned)).mode == "planned"


# ---- F9: the judge's run has a summary in the runs view ----------------------------------------

def test_the_judge_run_has_a_summary_and_totals_over_runs_include_its_cost(fresh_sim, tmp_path):
    sim, data = fresh_sim, tmp_path / "data"
    write_input(tmp_path)
    write(tmp_path, "pool.yaml", pool_doc(sim.url, [worker("fast", sim.url), worker("weak", sim.url)]))
    path = write(tmp_path, "job.yaml", job_doc(quality={"judge": {"worker": "weak", "rubric": "Be strict."}}))
    s = run_job(load_job(path), data_dir=data, progress=False)
    assert s["cost_usd"] > 0 and s["judge_cost_usd"] > 0
    con = duckdb.connect(str(data / "conductor.duckdb"), read_only=True)
    try:
        rows = dict(con.execute("SELECT run_id, CAST(summary->>'cost_usd' AS DOUBLE) FROM runs").fetchall())
        calls = con.execute("SELECT CAST(summary->>'calls' AS INTEGER) FROM runs WHERE run_id = ?",
                            [f"{s['run_id']}-judge"]).fetchone()[0]
    finally:
        con.close()
    assert rows[f"{s['run_id']}-judge"] == pytest.approx(s["judge_cost_usd"])
    assert sum(rows.values()) == pytest.approx(s["cost_usd"] + s["judge_cost_usd"])
    assert calls == 8


def kill_while_judging(path: Path, data: Path, earlier: frozenset[str] = frozenset(), lines: int = 4) -> Path:
    """Run the job in its own process and SIGKILL it once its judge run (not one of the `earlier`
    ones) has journaled `lines` steps; returns the judge run's folder."""
    proc = subprocess.Popen([sys.executable, "-m", "conductor", "job", "run", str(path), "--quiet", "--data-dir",
                             str(data)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline, found = time.monotonic() + 120, set()
    while proc.poll() is None and time.monotonic() < deadline:
        judging = [d for d in (data / "runs").glob("*-judge") if d.name not in earlier] \
            if (data / "runs").exists() else []
        if judging and line_count(judging[0] / "work" / "steps.jsonl") >= lines:
            os.killpg(proc.pid, signal.SIGKILL)
            found.add(judging[0])
            break
        time.sleep(0.005)
    proc.wait(timeout=30)
    assert found and proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    return found.pop()


@pytest.mark.parametrize("then", ["grown", "rubric"])
def test_a_killed_judge_run_a_later_run_supersedes_is_closed_with_what_it_paid(fresh_sim, tmp_path, then):
    """Killed while judging, then superseded: the job run was marked `abandoned` with its spend
    (`grown`: tomorrow's file has another row), or was left `created` for good (`rubric`: a
    rescoring run after a new rubric, every row reused, has no query set), and its judge run stayed
    without a summary, so the judge's paid calls showed in no total over the `runs` view."""
    sim, data = fresh_sim, tmp_path / "data"
    write_input(tmp_path, n=30)
    write(tmp_path, "pool.yaml", pool_doc(sim.url, [worker("fast", sim.url), worker("weak", sim.url)],
                                          concurrency=2))
    path = write(tmp_path, "job.yaml", job_doc(quality={"judge": {"worker": "weak", "rubric": "Be strict."}}))
    earlier: frozenset[str] = frozenset()
    if then == "rubric":
        first = run_job(load_job(path), data_dir=data, progress=False)
        earlier = frozenset({f"{first['run_id']}-judge"})
        write(tmp_path, "job.yaml", job_doc(quality={"judge": {"worker": "weak", "rubric": "Be lenient."}}))
    sim.set_faults("weak", latency_ms=150, latency_sd_ms=0)  # the judge is slow: the kill lands in it
    judge_dir = kill_while_judging(path, data, earlier)
    sim.clear_faults()
    if then == "grown":
        write_input(tmp_path, n=31)  # another row: the killed run cannot be resumed
    s = run_job(load_job(path), data_dir=data, progress=False)
    killed = judge_dir.name.removesuffix("-judge")
    assert [a["run_id"] for a in s["abandoned_runs"]] == [killed]
    assert orjson.loads((data / "runs" / killed / "manifest.json").read_bytes())["status"] == "abandoned"
    closed = orjson.loads((judge_dir / "manifest.json").read_bytes())
    assert closed["status"] == "abandoned"
    assert closed["summary"]["calls"] >= 4 and closed["summary"]["cost_usd"] > 0
    assert closed["summary"]["superseded_by"] == s["run_id"]
    con = duckdb.connect(str(data / "conductor.duckdb"), read_only=True)
    try:
        cost = con.execute("SELECT CAST(summary->>'cost_usd' AS DOUBLE) FROM runs WHERE run_id = ?",
                           [judge_dir.name]).fetchone()[0]
    finally:
        con.close()
    assert cost == pytest.approx(closed["summary"]["cost_usd"])
