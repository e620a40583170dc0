"""Audit 66 (the README's enrichment jobs as a demanding user): `--run-id` of an abandoned run, or of
a budget-stopped one with nothing left to compute, rewrote it and what it paid left the `runs` view;
the failure list after a budget stop split one cause by its dollar amounts and dropped the rest
unsaid; a rerun after a kill resumed without saying so; `--run-id` of a complete --full-refresh run
was refused without the flag; a field with no type, `fields: {}`, an empty id and a list id were
named badly or not at all. Counted at the simulated pool over HTTP."""

from __future__ import annotations

from pathlib import Path

import duckdb
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from conductor.cli.render import job_summary
from conductor.enrich import load_job
from conductor.enrich import run as enrich_run
from conductor.enrich.run import run_job
from tests.conftest import cli, kill_when_journaled, worker


def write_input(folder: Path, n: int, ids: list | None = None) -> None:
    pq.write_table(pa.table({"id": ids if ids is not None else [f"d{i}" for i in range(n)],
                             "text": [f"Invoice {i}: {100 + i} units of part P{i}." for i in range(n)]}),
                   folder / "input.parquet")


# Each call reserves $0.01 (the worker's max_call_usd, above its token bound) and costs about $0.00003:
# one call at a time, a budget of $0.0101 answers a few rows and stops the rest.
STOPS = {"budget_usd": 0.0101, "concurrency": 1, "max_call_usd": 0.01}


def write_job(folder: Path, url: str, n: int = 8, concurrency: int = 32, max_call_usd: float | None = None,
              **changes) -> Path:
    write_input(folder, n)
    fast = worker("fast", url, **({"max_call_usd": max_call_usd} if max_call_usd else {}))
    (folder / "pool.yaml").write_text(yaml.safe_dump({
        "providers": {"sim": {"max_concurrency": concurrency, "timeout_s": 10}},
        "workers": [fast, worker("weak", url)]}, sort_keys=False))
    doc = {"name": "docs", "input": {"path": "input.parquet", "id": "id"}, "prompt": "Note: {{ text }}",
           "fields": {"part": {"type": "string", "required": True}, "units": {"type": "number"}},
           "pool": "pool.yaml", "mode": "direct", "worker": "fast", **changes}
    (folder / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder / "job.yaml"


def manifest(data: Path, run_id: str) -> bytes:
    return (data / "runs" / run_id / "manifest.json").read_bytes()


def runs_view(data: Path) -> dict[str, tuple]:
    r = cli("sql", "--data-dir", data, "--format", "csv",
                "SELECT run_id, status, summary->>'cost_usd' FROM runs ORDER BY run_id")
    assert r.returncode == 0, r.stderr
    return {line.split(",")[0]: tuple(line.split(",")[1:]) for line in r.stdout.split()[1:]}


def _killed_run(sim, tmp_path: Path, data: Path):
    """A 40-row job killed once six steps are journaled: its job file and run folder."""
    path = write_job(tmp_path, sim.url, n=40, concurrency=2)
    sim.set_faults("*", latency_ms=100, latency_sd_ms=0)
    killed = kill_when_journaled(["job", "run", path, "--quiet"], data, lines=6)
    assert killed is not None, "the run ended before it could be killed"
    sim.clear_faults()
    return path, killed


# ---- F2: --run-id of a run that asked for rows is never rewritten by a run of other rows ------------

def test_run_id_of_an_abandoned_run_is_refused_and_what_it_paid_stays_in_the_runs_view(fresh_sim, tmp_path):
    sim, data = fresh_sim, tmp_path / "data"
    path, killed = _killed_run(sim, tmp_path, data)
    write_input(tmp_path, 30)  # ten rows dropped: the rerun cannot continue the killed run
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 0 and f"interrupted run {killed.name}" in r.stdout, r.stdout + r.stderr
    before = manifest(data, killed.name)
    paid = orjson.loads(before)["summary"]
    assert orjson.loads(before)["status"] == "abandoned" and paid["cost_usd"] > 0
    sim.reset()
    r = cli("job", "run", path, "--data-dir", data, "--quiet", "--run-id", killed.name)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"run {killed.name} already exists" in r.stderr and "abandoned" in r.stderr, r.stderr
    assert "it is kept as it is: choose another --run-id (or omit it)" in r.stderr
    assert manifest(data, killed.name) == before and sim.log()["total"] == 0
    assert runs_view(data)[killed.name][0] == "abandoned"
    assert float(runs_view(data)[killed.name][1]) == paid["cost_usd"]


def test_run_id_of_a_budget_stopped_run_with_every_row_reused_since_is_refused(fresh_sim, tmp_path):
    """Every row reused from the newer run left nothing to compute, which skipped the check of the
    run's rows: it was marked complete with $0 and 0 calls."""
    sim, data = fresh_sim, tmp_path / "data"
    path = write_job(tmp_path, sim.url, **STOPS)
    first = run_job(load_job(path), data_dir=data, progress=False)
    assert first["statuses"].get("budget_exhausted") and first["cost_usd"] > 0
    before = manifest(data, first["run_id"])
    write_job(tmp_path, sim.url, **{**STOPS, "budget_usd": 1.0})
    second = run_job(load_job(path), data_dir=data, progress=False)
    assert second["valid"] == 8
    sim.reset()
    r = cli("job", "run", path, "--data-dir", data, "--quiet", "--run-id", first["run_id"])
    assert r.returncode == 2 and f"run {first['run_id']} already exists" in r.stderr, r.stdout + r.stderr
    assert "it is kept as it is" in r.stderr
    assert manifest(data, first["run_id"]) == before and sim.log()["total"] == 0
    status, usd = runs_view(data)[first["run_id"]]
    assert status == "incomplete" and float(usd) == first["cost_usd"]


# ---- F3: one line per cause, and the rows not shown are counted ------------------------------------

def test_a_budget_stop_is_one_cause_whatever_the_amounts_and_the_rows_left_out_are_counted():
    budget = [f"worker mid: budget exhausted: run cap $0.0500, spent ${0.0481 + i / 10000:.4f}, this call needs "
              f"up to ${0.0013 + (i % 4) / 10000:.4f}" for i in range(12)]
    other = [f"final output: cause {k}" for k in range(7) for _ in range(2)]
    table = pa.table({"status": ["budget_exhausted"] * 12 + ["invalid"] * 14 + ["ok"],
                      "error": budget + other + [None]})
    shown, rest = enrich_run.record_failure_groups(table)
    assert shown[0] == {"status": "budget_exhausted", "rows": 12,
                        "error": "worker mid: budget exhausted: run cap $0.0500, spent $0.0481 to $0.0492, this call "
                                 "needs up to $0.0013 to $0.0016"}
    assert len(shown) == 5 and rest == {"rows": 6, "groups": 3}
    out = job_summary({"job": "docs", "run_id": "r", "rows": 27, "computed": 15, "reused": 0, "valid": 1,
                       "statuses": {"ok": 1, "invalid": 14, "budget_exhausted": 12}, "calls": 15, "cost_usd": 0.05,
                       "metrics": {"valid_share": 1 / 27, "fields": {}}, "wall_time_s": 1.0,
                       "records_path": "data/runs/r/records.parquet", "failures": shown,
                       "failures_not_shown": rest})
    assert ("  ... and 6 more row(s) under 3 other cause(s): see the status and error columns of "
            "data/runs/r/records.parquet") in out, out


def test_the_failure_list_of_a_budget_stopped_run_accounts_for_every_stopped_row(fresh_sim, tmp_path):
    """Long rows and short ones in turn, one call at a time: once a long row's worst case no longer
    fits, short rows still run, so each stopped row names another spend so far and worst case."""
    path = write_job(tmp_path, fresh_sim.url, n=16, budget_usd=0.007, concurrency=1)
    longer = [" Shipped in good order." * (40 + 8 * i) if i % 2 else "" for i in range(16)]
    texts = [f"Invoice {i}: {100 + i} units of part P{i}.{longer[i]}" for i in range(16)]
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(16)], "text": texts}), tmp_path / "input.parquet")
    r = cli("job", "run", path, "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 3, r.stdout + r.stderr
    stopped = int(r.stdout.split("stopped by a budget ")[1].split(",")[0])
    listed = r.stdout.split("rows without a valid record (a rerun retries them):\n")[1].splitlines()
    budget = [x for x in listed if "budget_exhausted" in x]
    assert len(budget) == 1 and budget[0].startswith(f"  {stopped} budget_exhausted: "), r.stdout


# ---- F4: a rerun after a kill says it resumes, and what it keeps -----------------------------------

def test_a_rerun_after_a_kill_says_it_resumes_the_run_and_what_was_answered_there(fresh_sim, tmp_path):
    sim, data = fresh_sim, tmp_path / "data"
    path, killed = _killed_run(sim, tmp_path, data)
    r = cli("job", "run", path, "--data-dir", data)
    assert r.returncode == 0, r.stderr
    said = next((x for x in r.stderr.splitlines() if "resuming interrupted run" in x), "")
    assert f"resuming interrupted run {killed.name}: " in said and "are kept, not asked again" in said, r.stderr
    calls = int(said.split(": ")[1].split(" call(s)")[0])
    assert calls >= 6
    run_line = next(x for x in r.stdout.splitlines() if x.startswith("run "))
    assert run_line.split()[1] == killed.name and f"(resumed: {calls} call(s) answered before it was " in run_line
    summary = orjson.loads((killed / "summary.json").read_bytes())
    assert summary["resumed"] is True and summary["resumed_kept"]["calls"] == calls and summary["calls"] == 40
    again = cli("job", "run", path, "--data-dir", data)  # a new run, reusing every row: nothing resumed
    assert "resuming" not in again.stderr and "(resumed" not in again.stdout, again.stdout


# ---- F5: how a complete run was made does not matter to look at it ---------------------------------

def test_run_id_of_a_complete_full_refresh_run_is_shown_without_the_flag(fresh_sim, tmp_path):
    sim, data = fresh_sim, tmp_path / "data"
    path = write_job(tmp_path, sim.url)
    first = run_job(load_job(path), data_dir=data, progress=False, full_refresh=True)
    before = manifest(data, first["run_id"])
    sim.reset()
    r = cli("job", "run", path, "--data-dir", data, "--quiet", "--run-id", first["run_id"])
    assert r.returncode == 0 and "complete already: nothing executed, nothing written" in r.stdout, r.stderr
    assert manifest(data, first["run_id"]) == before and sim.log()["total"] == 0


def test_full_refresh_with_the_run_id_of_a_complete_run_made_without_it_says_how_to_proceed(fresh_sim, tmp_path):
    data = tmp_path / "data"
    path = write_job(tmp_path, fresh_sim.url)
    first = run_job(load_job(path), data_dir=data, progress=False)
    r = cli("job", "run", path, "--data-dir", data, "--quiet", "--run-id", first["run_id"], "--full-refresh")
    assert r.returncode == 2, r.stdout
    assert "complete, made without --full-refresh" in r.stderr, r.stderr
    assert "to recompute every row, omit --run-id (a new run) or choose a new one" in r.stderr


# ---- F8: a field with no type, and `fields: {}` -----------------------------------------------------

def test_a_field_without_a_type_is_named_as_missing_and_empty_fields_as_empty(fresh_sim, tmp_path):
    path = write_job(tmp_path, fresh_sim.url)
    doc = yaml.safe_load(path.read_text())
    doc["fields"]["units"] = {"description": "how many"}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = cli("job", "check", path)
    assert r.returncode == 2 and "fields.units.type: required (one of string, number, integer" in r.stderr, r.stderr
    assert "None" not in r.stderr
    doc["fields"] = {}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert "fields: is empty; give at least one field, or remove the `fields` key for a plain-text job" in r.stderr
    assert "must be a mapping" not in r.stderr


# ---- F9: an empty id, and a list id column -----------------------------------------------------------

def test_an_empty_or_blank_id_is_refused_naming_its_rows(fresh_sim, tmp_path):
    path = write_job(tmp_path, fresh_sim.url)
    write_input(tmp_path, 4, ids=["a", "", "c", "  "])
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert "id column 'id' has 2 empty or blank value(s) (row(s) 2, 4)" in r.stderr, r.stderr
    r = cli("job", "run", path, "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 2 and "empty or blank" in r.stderr and not (tmp_path / "data" / "runs").exists()


def test_a_list_id_column_is_refused_naming_the_column_and_its_type(fresh_sim, tmp_path):
    path = write_job(tmp_path, fresh_sim.url)
    write_input(tmp_path, 3, ids=[[1], [2], [3]])
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert "id column 'id' holds lists (List(Int64)); an id is one string or integer per row" in r.stderr, r.stderr
    r = cli("job", "run", path, "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 2 and not (tmp_path / "data" / "runs").exists()
