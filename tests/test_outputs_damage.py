"""Outputs as a user queries them when something went wrong (audit 33): a damaged manifest or
Parquet file, a run stopped by a signal or whose plans failed, a query file with an odd name."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import duckdb
import orjson
import pyarrow.parquet as pq
import pytest

from conductor import schemas
from conductor.store import RunDir, catalog_is_current, refresh_catalog, write_table
from tests.conftest import REPO, cli, run_cli, write_pool


def _cut(path, keep=0.5):
    path.write_bytes(path.read_bytes()[:int(path.stat().st_size * keep)])


def _csv_rows(out: str) -> list[list[str]]:
    return [line.split(",") for line in out.strip().splitlines()[1:]]


@pytest.fixture(scope="module")
def made(tmp_path_factory, sim, sample_queries):
    """Two finished runs, a and b, of 4 queries; each test gets its own copy of their data folder."""
    sim.clear_faults()
    root = tmp_path_factory.mktemp("made")
    pool = write_pool(root / "pool.yaml", sim.url, names=("fast",))
    queries = root / "q4.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 4), queries)
    cmd = ("run", queries, "--pool", pool, "--quiet")
    for run_id in ("a", "b"):
        r = run_cli(*cmd, "--data-dir", root / "data", "--run-id", run_id)
        assert r.returncode == 0, r.stdout + r.stderr

    def copy(tmp_path):
        data = tmp_path / "data"
        shutil.copytree(root / "data", data)
        return data, (*cmd, "--data-dir", data)

    return copy


# ---- F3: a damaged manifest.json ------------------------------------------------

@pytest.mark.slow  # whole runs through the CLI
def test_a_damaged_manifest_fails_its_run_clearly_and_leaves_the_other_runs_queryable(tmp_path, made):
    """`conductor run` on a run whose manifest was cut short or overwritten ended in a traceback
    (exit 1), and the `runs` view failed for every run."""
    data, cmd = made(tmp_path)
    manifest = data / "runs" / "b" / "manifest.json"
    whole = manifest.read_bytes()
    for damage in (b"x\n", b"[1, 2]", whole[:len(whole) // 2]):
        manifest.write_bytes(damage)
        r = cli(*cmd, "--run-id", "b")
        assert r.returncode == 2, r.stderr
        assert f"run b: its manifest {manifest} is damaged" in r.stderr and "mv " in r.stderr, r.stderr
        r = cli("sql", "SELECT run_id, status FROM runs ORDER BY 1", "--data-dir", data, "--format", "csv")
        assert r.returncode == 0 and _csv_rows(r.stdout) == [["a", "complete"]], r.stdout + r.stderr
        assert "leaves out 1 damaged file(s)" in r.stderr and str(manifest) in r.stderr, r.stderr
    # Another run finishes; its catalog line names the file left out
    r = run_cli(*cmd, "--run-id", "c")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "leaves out 1 damaged file(s)" in r.stdout and str(manifest) in r.stdout, r.stdout
    manifest.write_bytes(whole)  # restored in place: the catalog sees it again
    r = cli("sql", "SELECT run_id FROM runs ORDER BY 1", "--data-dir", data, "--format", "csv")
    assert _csv_rows(r.stdout) == [["a"], ["b"], ["c"]] and r.stderr == "", r.stdout + r.stderr


# ---- F4: a damaged Parquet file ------------------------------------------------

@pytest.mark.slow  # whole runs through the CLI
def test_a_damaged_table_is_left_out_of_its_view_with_what_to_do_and_the_rerun_it_names_fixes_it(tmp_path, made):
    """One truncated Parquet file made every query on its table fail, for every run."""
    data, cmd = made(tmp_path)
    traces, rewards = data / "runs" / "b" / "traces.parquet", data / "runs" / "a" / "rewards.parquet"
    _cut(traces)
    rewards.write_bytes(b"garbage\n")
    query = "SELECT run_id, count(*) AS n FROM traces GROUP BY ALL ORDER BY 1"
    for _ in range(2):  # said by every `conductor sql` while the files are damaged, not only the first
        r = cli("sql", query, "--data-dir", data, "--format", "csv")
        assert r.returncode == 0 and [row[0] for row in _csv_rows(r.stdout)] == ["a"], r.stdout + r.stderr
        assert "leaves out 2 damaged file(s)" in r.stderr and str(traces) in r.stderr and str(rewards) in r.stderr
        assert "--run-id b: it rewrites the file from the run's work/ journal" in r.stderr, r.stderr
        assert "--run-id a: it grades the run again" in r.stderr and "mv " in r.stderr, r.stderr
    r = cli("sql", "SELECT run_id FROM rewards GROUP BY ALL", "--data-dir", data, "--format", "csv")
    assert r.returncode == 0 and _csv_rows(r.stdout) == [["b"]], r.stdout + r.stderr

    # The advice holds: each rerun rewrites its file, and pays for nothing
    r = run_cli(*cmd, "--run-id", "b")
    assert r.returncode == 0 and "leaves out 1 damaged file(s)" in r.stdout and str(rewards) in r.stdout, r.stdout
    r = run_cli(*cmd, "--run-id", "a")
    assert r.returncode == 0 and "leaves out" not in r.stdout, r.stdout
    r = cli("sql", query, "--data-dir", data, "--format", "csv")
    assert [row[0] for row in _csv_rows(r.stdout)] == ["a", "b"] and r.stderr == "", r.stdout + r.stderr

    # A plans.parquet no rerun rewrites: `conductor run` names it, no traceback
    plans = data / "runs" / "b" / "plans.parquet"
    _cut(plans)
    r = cli(*cmd, "--run-id", "b")
    assert r.returncode == 2 and f"{plans} is damaged" in r.stderr and "mv " in r.stderr, r.stderr


def _runs_folder(root, n=2):
    """Run folders as runs write them (tables of the declared schemas, a manifest), without a run."""
    for i in range(n):
        run = RunDir(root, f"r{i}")
        for name, schema in schemas.TABLES.items():
            write_table(run.table(name), schema.empty_table())
        run.write_manifest({"run_id": run.run_id, "status": "complete", "created_at": "2026-11-27T00:00:00+00:00"})
    return root / "runs"


def test_the_catalog_checks_footers_only_when_files_changed_and_leaves_out_damaged_ones(tmp_path, monkeypatch):
    from conductor import store
    from conductor.store import damaged_file_advice

    runs = _runs_folder(tmp_path)
    read = []
    real = store.file_damage
    monkeypatch.setattr(store, "file_damage", lambda p: read.append(p) or real(p))
    refresh_catalog(tmp_path)
    assert len(read) == 10 and catalog_is_current(tmp_path)  # 4 tables and a manifest per run
    read.clear()
    r = cli("sql", "SELECT count(*) FROM runs", "--data-dir", tmp_path, "--format", "csv")
    assert r.returncode == 0 and r.stdout.split() == ["count_star()", "2"] and not read, r.stderr

    _cut(runs / "r1" / "results.parquet")  # damaged in place: its size and time changed
    assert not catalog_is_current(tmp_path)
    r = cli("sql", "SELECT run_id FROM results", "--data-dir", tmp_path)
    assert r.returncode == 0 and str(runs / "r1" / "results.parquet") in r.stderr, r.stderr
    assert "move the run folder out of" in r.stderr, r.stderr
    assert not catalog_is_current(tmp_path)  # checked again next time, until fixed
    notes = []
    refresh_catalog(tmp_path, warn=notes.append)
    assert len(notes) == 1 and "leaves out 1 damaged file(s)" in notes[0]

    # A file damaged since the catalog was last refreshed fails the query: the advice for its DuckDB error
    with pytest.raises(duckdb.Error) as e:
        duckdb.sql(f"SELECT * FROM read_parquet('{runs / 'r1' / 'results.parquet'}')").fetchall()
    advice = damaged_file_advice(str(e.value))
    assert advice.startswith(f"{runs / 'r1' / 'results.parquet'} is damaged") and "mv " in advice, advice
    assert damaged_file_advice("Binder Error: column nope not found") is None


# ---- F5: a run stopped by a signal, a run whose plans failed ----------------------

def _status(data):
    return orjson.loads(next(data.glob("runs/*/manifest.json")).read_bytes())["status"]


@pytest.mark.slow  # a run interrupted and resumed through the CLI
@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_run_stopped_by_a_signal_is_recorded_interrupted_until_the_rerun_resumes_it(
        tmp_path, fresh_sim, sample_queries, sig, code):
    """It stayed `executing` for good: in the runs view, like a live run."""
    from tests.test_hardening import _queries, _wait_for

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("slow",), providers={"sim": {"max_concurrency": 2}})
    data = tmp_path / "data"
    args = ["run", str(_queries(tmp_path, sample_queries, 12)), "--pool", str(pool), "--data-dir", str(data),
            "--quiet", "--no-cache"]
    p = subprocess.Popen([sys.executable, "-m", "conductor", *args], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    _wait_for(fresh_sim, 2)
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    assert _status(data) == "interrupted"
    r = cli("sql", "SELECT status FROM runs", "--data-dir", data, "--format", "csv")
    assert r.stdout.split() == ["status", "interrupted"], r.stdout + r.stderr
    r = run_cli(*args)
    assert r.returncode == 0 and "(resumed)" in r.stdout, r.stdout + r.stderr
    assert _status(data) == "complete"


@pytest.mark.slow  # whole runs through the CLI
def test_a_run_whose_plans_failed_records_its_failed_share_and_exit_code(tmp_path, fresh_sim, sample_queries):
    """Exit 4 (more than --max-failed-share of the plans failed) was recorded `complete` and
    nothing else: a query for usable runs picked a run without one answer."""
    from tests.test_hardening import _queries

    fresh_sim.set_faults("fast", fail_status=404)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    data = tmp_path / "data"
    cmd = ("run", _queries(tmp_path, sample_queries, 4), "--pool", pool, "--data-dir", data, "--quiet", "--no-cache")
    r = run_cli(*cmd)
    assert r.returncode == 4, r.stdout + r.stderr
    summary = orjson.loads(next(data.glob("runs/*/summary.json")).read_bytes())
    assert (summary["failed_plans"], summary["failed_share"], summary["exit_code"]) == (4, 1.0, 4)
    query = ("SELECT status, summary->>'exit_code' AS exit_code, (summary->>'failed_share')::DOUBLE AS failed_share "
             "FROM runs")
    r = cli("sql", query, "--data-dir", data, "--format", "csv")
    assert _csv_rows(r.stdout) == [["complete", "4", "1.0"]], r.stdout + r.stderr

    fresh_sim.clear_faults()
    r = run_cli(*cmd, "--retry-failed")
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("sql", query, "--data-dir", data, "--format", "csv")
    assert _csv_rows(r.stdout) == [["complete", "0", "0.0"]], r.stdout + r.stderr


# ---- F7: the default run id of a query file with an odd name ----------------------

def test_the_default_run_id_keeps_valid_file_names_and_cleans_the_others():
    from conductor.runids import run_id_stem, valid_run_id

    for stem in ("sample", "q5.v1-x_y", "café", "a" * 117):  # ids of runs on disk: unchanged
        assert run_id_stem(stem) == stem
    assert run_id_stem("my q (v2)") == "my_q_v2"
    assert run_id_stem(".hidden") == "hidden"
    assert run_id_stem("((  ))") == "queries"
    for stem in ("my q (v2)", ".hidden", "a b" * 100, "((  ))", "x/y?z*"):
        assert valid_run_id(f"{run_id_stem(stem)}-0123456789"), stem


@pytest.mark.slow  # whole runs through the CLI
def test_a_query_file_named_with_spaces_and_parentheses_runs_without_run_id(tmp_path, fresh_sim, sample_queries):
    """It was refused with "--run-id 'my q (v2)-...': use letters, digits..." though no --run-id was given."""
    queries = tmp_path / "my q (v2).parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 3), queries)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    cmd = ("run", queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet")
    r = run_cli(*cmd)
    assert r.returncode == 0, r.stdout + r.stderr
    (run,) = (tmp_path / "data" / "runs").iterdir()
    assert re.fullmatch(r"my_q_v2-[0-9a-f]{10}", run.name), run.name
    r = run_cli(*cmd)
    assert r.returncode == 0 and f"{run.name}  (resumed)" in r.stdout, r.stdout + r.stderr
