"""`conductor job run` when it refuses, or is given what it must not rewrite: a refusal leaves no
half-made run folder, a complete run named by --run-id is left as it was, a damaged earlier
records file or a bad --data-dir is named instead of a traceback; and the summary says what its
figures mean (unknown prices, rows a budget stopped, calls lost in flight, long errors)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.cli.render import job_summary, run_summary
from conductor.enrich import load_job
from conductor.enrich.run import record_failure_groups, run_job
from conductor.errors import ConductorError
from tests.conftest import cli, files_under, worker

IDS = [f"r{i}" for i in range(8)]
TEXTS = [f"Invoice {i}: {100 + 7 * i} units of part {chr(65 + i)} shipped on day {i + 3}." for i in range(8)]


def write_job(folder: Path, url: str, *, price: bool = True, model: str = "openai/fast",
              judge_model: str | None = None, **extra) -> Path:
    """An 8-row job on the simulated `fast` worker; `judge_model` adds a judge on `weak` with that model."""
    pq.write_table(pa.table({"id": IDS, "text": TEXTS}), folder / "input.parquet")
    fast = worker("fast", url, model=model)
    if not price:
        del fast["price"]
    weak = worker("weak", url, model=judge_model or "openai/weak")
    (folder / "pool.yaml").write_text(yaml.safe_dump({
        "providers": {"sim": {"max_concurrency": 8, "timeout_s": 10}}, "workers": [fast, weak]}, sort_keys=False))
    doc = {"name": "notes", "input": {"path": "input.parquet", "id": "id"}, "prompt": "Note: {{ text }}",
           "fields": {"part": {"type": "string", "required": True}, "units": {"type": "number"}},
           "pool": "pool.yaml", "mode": "direct", "worker": "fast", **extra}
    if judge_model:
        doc["quality"] = {"judge": {"worker": "weak", "rubric": "Every field must be in the text."}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_folders(data: Path) -> list[str]:
    runs = data / "runs"
    return sorted(p.name for p in runs.iterdir()) if runs.exists() else []


# ---- F4: a refusal leaves nothing behind --------------------------------------------

def test_a_setting_refused_after_the_run_started_leaves_no_run_folder(fresh_sim, tmp_path, monkeypatch):
    """The runner refuses a bad CONDUCTOR_RESERVE_BYTES after the job wrote its query set: the run
    folder held queries.parquet and no manifest, and `conductor sql` then failed on the catalog."""
    data = tmp_path / "data"
    path = write_job(tmp_path, fresh_sim.url)
    monkeypatch.setenv("CONDUCTOR_RESERVE_BYTES", "abc")
    with pytest.raises(ConductorError, match="CONDUCTOR_RESERVE_BYTES='abc'"):
        run_job(load_job(path), data_dir=data, progress=False)
    assert run_folders(data) == [] and files_under(data / "runs") == []
    r = cli("sql", "--data-dir", data, "select count(*) from runs")
    assert "Catalog Error" not in r.stderr and "no runs under" in r.stderr, r.stderr
    monkeypatch.delenv("CONDUCTOR_RESERVE_BYTES")
    s = run_job(load_job(path), data_dir=data, progress=False)
    assert s["valid"] == 8 and run_folders(data) == [s["run_id"]]


def test_a_preflight_refusal_leaves_no_run_folder_and_the_fixed_rerun_is_the_only_run(fresh_sim, tmp_path,
                                                                                     sample_queries):
    """A worker whose model the endpoint does not serve is refused after planning, before any
    call: the folder it left (manifest and plans, no call) stayed in the catalog for good."""
    data = tmp_path / "data"
    path = write_job(tmp_path, fresh_sim.url, model="openai/nosuch")
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 2 and "does not serve model 'nosuch'" in r.stderr, r.stderr
    assert "plans are saved" not in r.stderr  # they went with the folder (audit51 N8)
    # nor is the deleted run to be resumed, or deleted by hand (its advice is `conductor run`'s)
    assert "resumes it with these plans" not in r.stderr and "can be deleted" not in r.stderr, r.stderr
    assert "(run " not in r.stderr and "fix this and rerun" in r.stderr, r.stderr
    ran = cli("run", sample_queries, "--pool", tmp_path / "pool.yaml", "--data-dir", tmp_path / "other", "--quiet")
    assert ran.returncode == 2 and "plans are saved" in ran.stderr, ran.stderr
    assert "the same command resumes it with these plans (run " in ran.stderr, ran.stderr
    assert run_folders(data) == [] and fresh_sim.log()["total"] == 0
    write_job(tmp_path, fresh_sim.url)
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 0, r.stderr
    (only,) = run_folders(data)
    r = cli("sql", "--data-dir", data, "select run_id from runs", "--format", "csv")
    assert r.returncode == 0 and r.stdout.split() == ["run_id", only], r.stdout + r.stderr


def test_a_refused_judge_leaves_no_judge_folder_and_keeps_the_paid_extraction(fresh_sim, tmp_path):
    """The judge's preflight refuses after extraction has paid: the extraction's run stays (its
    journal, resumed or abandoned by the rerun), the judge's folder, which sent nothing, goes."""
    data = tmp_path / "data"
    path = write_job(tmp_path, fresh_sim.url, judge_model="openai/nosuch")
    with pytest.raises(ConductorError, match="does not serve model 'nosuch'"):
        run_job(load_job(path), data_dir=data, progress=False)
    (run,) = run_folders(data)
    assert not run.endswith("-judge") and (data / "runs" / run / "work" / "steps.jsonl").exists()
    assert fresh_sim.log()["by_model"] == {"fast": 8}


# ---- F7: --run-id of a complete run ---------------------------------------------------

def test_run_id_of_a_complete_run_executes_and_writes_nothing(fresh_sim, tmp_path):
    """Given with a newer run on disk, the earlier run's records were replaced by the newer run's
    (as reused) and its spend dropped to $0 in the `runs` view."""
    data = tmp_path / "data"
    path = write_job(tmp_path, fresh_sim.url)
    first = run_job(load_job(path), data_dir=data, progress=False)
    run_job(load_job(path), data_dir=data, full_refresh=True, progress=False)
    folder = data / "runs" / first["run_id"]
    before = {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}
    fresh_sim.reset()
    r = cli("job", "run", path, "--data-dir", data, "--run-id", first["run_id"], "--quiet")
    assert r.returncode == 0, r.stderr
    assert f"{first['run_id']}  (complete already: nothing executed, nothing written)" in r.stdout
    assert f"${first['cost_usd']:.6f}" in r.stdout and fresh_sim.log()["total"] == 0
    assert {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()} == before
    r = cli("sql", "--data-dir", data, "--format", "csv",
                f"select summary->>'$.cost_usd' as usd from runs where run_id = '{first['run_id']}'")
    assert r.returncode == 0 and first["cost_usd"] > 0
    assert float(r.stdout.split()[1]) == pytest.approx(first["cost_usd"])

    # For another definition it is refused, and still left as it was.
    path.write_text(path.read_text().replace("Note: {{ text }}", "A note: {{ text }}"))
    r = cli("job", "run", path, "--data-dir", data, "--run-id", first["run_id"], "--quiet")
    assert r.returncode == 2 and f"run {first['run_id']} already exists" in r.stderr, r.stderr
    assert "another definition" in r.stderr and "Traceback" not in r.stderr
    assert {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()} == before
    assert fresh_sim.log()["total"] == 0


# ---- F8, F9: damaged records, a bad --data-dir ---------------------------------------------

def test_a_damaged_newest_records_file_is_named_with_what_to_do(fresh_sim, tmp_path):
    data = tmp_path / "data"
    path = write_job(tmp_path, fresh_sim.url)
    first = run_job(load_job(path), data_dir=data, progress=False)
    records = Path(first["records_path"])
    os.truncate(records, 100)
    fresh_sim.reset()
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{records} is damaged (" in r.stderr and "move the run folder out of" in r.stderr
    assert fresh_sim.log()["total"] == 0 and run_folders(data) == [first["run_id"]]


def test_a_data_dir_that_is_a_file_or_a_pattern_is_refused_before_anything_is_made(fresh_sim, tmp_path):
    path = write_job(tmp_path, fresh_sim.url)
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = cli("job", "run", path, "--data-dir", afile, "--quiet")
    assert r.returncode == 2 and f"--data-dir {afile}: is a file; give a folder" in r.stderr, r.stderr
    pattern = tmp_path / "dx[1]"
    r = cli("job", "run", path, "--data-dir", pattern, "--quiet")
    assert r.returncode == 2 and "which DuckDB reads as a file pattern" in r.stderr, r.stderr
    assert not pattern.exists() and fresh_sim.log()["total"] == 0


# ---- F6, F10, F11: what the summary says ----------------------------------------------

def test_rows_without_a_known_price_are_said_not_shown_as_zero(fresh_sim, tmp_path):
    data = tmp_path / "data"
    path = write_job(tmp_path, fresh_sim.url, price=False)
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 0, r.stderr
    cost = next(line for line in r.stdout.splitlines() if line.startswith("cost"))
    assert cost.split(None, 1)[1] == "$0.000000  (8 row(s) with unknown price)"


def summary(**changes) -> dict:
    s = {"job": "notes", "run_id": "notes-1", "rows": 600, "computed": 84, "reused": 0, "valid": 84,
         "statuses": {"ok": 84, "budget_exhausted": 516}, "calls": 84, "cost_usd": 0.012, "unpriced_rows": 0,
         "metrics": {"valid_share": 0.14, "fields": {}}, "wall_time_s": 1.0, "records_path": "r.parquet",
         "lost_in_flight": {"calls": 2, "reserved_usd": 0.0016, "unpriced_calls": 0}}
    return {**s, **changes}


def test_the_summary_counts_budget_stopped_rows_apart_and_says_why_the_judge_judged_none():
    out = job_summary(summary(metrics={"valid_share": 0.14, "fields": {},
                                       "judge": {"mean_score": None, "judged_rows": 0, "stale_rows": 0}},
                              judge_budget_exhausted=14))
    assert re.search(r"^rows +600  \(computed 84, stopped by a budget 516, reused 0 at \$0\)$", out, re.M), out
    assert "no row judged; 14 record(s) the budget left unjudged or not yet rescored" in out


def test_lost_in_flight_names_no_budget_lines_the_summary_does_not_print():
    for out in (job_summary(summary()),
                run_summary({"run_id": "r", "queries": 1, "plans": 1, "valid_plans": 1, "statuses": {"ok": 1},
                             "calls": 1, "cache_hits": 0, "accuracy": None, "graded": 0, "cost_usd": 0.1,
                             "cost_per_query_usd": 0.1, "plans_without_price": 0, "tokens_per_query": 1.0,
                             "wall_time_s": 1.0, "spend": [], "outputs": "o",
                             "lost_in_flight": {"calls": 2, "reserved_usd": 0.0016}})):
        line = next(x for x in out.splitlines() if x.startswith("lost in flight"))
        assert "budget lines" not in line and line.endswith("$0.001600 at their worst case; budgets count them at "
                                                            "that, cost does not")


def test_a_long_error_is_cut_in_the_middle_with_a_marker_keeping_its_advice():
    batch = ("worker mid (openai/sim-mid): could not create the batch: BadRequestError: Error code: 400 - "
             "completion_window must be '24h' (got '48h').; no line of it ran: check provider sim's batch_* "
             "options in the pool file, then rerun")
    body = "Rate limit reached for sim-mid. " + "x" * 500 + " Please retry after 700 s, or lower rpm in the pool file"
    table = pa.table({"status": ["error", "error", "ok"], "error": [batch, body, None]})
    shown = {f["error"] for f in record_failure_groups(table)[0]}
    assert batch in shown  # whole: short enough
    (cut,) = shown - {batch}
    assert cut.startswith("Rate limit reached for sim-mid.") and " ... " in cut and len(cut) < 300
    assert cut.endswith("Please retry after 700 s, or lower rpm in the pool file")
