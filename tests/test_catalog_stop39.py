"""The catalog says what every run has paid, and the store's catalog reads runs whose carried-over
column differs in type as the local one does (stop 39). An interrupted run had a null summary in
the `runs` view, so `SELECT sum(...) FROM runs` missed what it had paid; `conductor sql --store`
failed for every run once two runs' query sets carried a column of different types. Real runs
against the simulated pool, stopped by SIGINT as Ctrl-C stops them; a real S3-compatible server."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

import duckdb
import orjson
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, cli, line_count, run_cli, write_pool

HAS_MOTO = importlib.util.find_spec("moto") is not None
if HAS_MOTO:
    from tests.test_s3_store import s3  # noqa: F401 - the fixture: moto's server on 127.0.0.1, a bucket made

needs_moto = pytest.mark.skipif(not HAS_MOTO, reason="moto[server] is not installed (pip install -e '.[test]')")

RUNS_COLUMNS = [("run_id", "VARCHAR"), ("status", "VARCHAR"), ("created_at", "TIMESTAMP WITH TIME ZONE"),
                ("updated_at", "TIMESTAMP WITH TIME ZONE"), ("inputs", "JSON"), ("summary", "JSON")]


def _rows(r) -> list[dict]:
    assert r.returncode == 0, r.stdout + r.stderr
    return [orjson.loads(line) for line in r.stdout.splitlines()]


def _run_cap(spend: list[dict]) -> float:
    return next(c["spent_usd"] for c in spend if c["cap"] == "run")


def _interrupted_run(args: list, steps) -> None:
    """`conductor ARGS` stopped by SIGINT (Ctrl-C) once its journal `steps` holds two paid steps."""
    p = subprocess.Popen([sys.executable, "-m", "conductor", *map(str, args)], cwd=REPO, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while line_count(steps) < 2 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, f"the run ended before it was stopped: {p.stderr.read()}"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err


def _slow_pool(tmp_path, sim):
    return write_pool(tmp_path / "slow.yaml", sim.url, names=("slow",), providers={"sim": {"max_concurrency": 2}})


def _check_spend(rows: dict, stopped: dict, done: dict) -> None:
    """The runs view's rows against the manifests: an interrupted run's spend is its manifest's, a
    finished run's is its summary's."""
    assert stopped["status"] == "interrupted" and stopped.get("summary") is None, stopped
    assert rows["stopped"]["status"] == "interrupted" and rows["stopped"]["summary"] is None
    assert rows["stopped"]["spent_usd"] == _run_cap(stopped["spend"]) > 0, (rows["stopped"], stopped["spend"])
    assert rows["stopped"]["spend"] == stopped["spend"]
    assert rows["stopped"]["lost_in_flight"] == stopped["lost_in_flight"]
    assert rows["stopped"]["interrupted_wall_time_s"] == stopped.get("interrupted_wall_time_s")
    summary = done["summary"]
    assert rows["done"]["spent_usd"] == _run_cap(summary["spend"]) > 0
    assert rows["done"]["spent_usd"] == pytest.approx(summary["cost_usd"], abs=1e-6)
    assert rows["done"]["interrupted_wall_time_s"] is None
    # What each ran with: the interrupted run has no summary, so its manifest's settings (stop 41)
    assert rows["stopped"]["settings"] == stopped["settings"] and "cost_penalty" in stopped["settings"]
    assert rows["done"]["settings"] == summary["settings"] and "max_failed_share" in summary["settings"]


@pytest.mark.slow  # whole runs through the CLI, one stopped by Ctrl-C
def test_an_interrupted_runs_spend_is_in_the_runs_view_beside_finished_and_old_runs(
        tmp_path, fresh_sim, sample_queries):
    data = tmp_path / "data"
    _interrupted_run(["run", sample_queries, "--pool", _slow_pool(tmp_path, fresh_sim), "--data-dir", data,
                      "--run-id", "stopped", "--quiet", "--no-cache"],
                     data / "runs" / "stopped" / "work" / "steps.jsonl")
    fast = write_pool(tmp_path / "fast.yaml", fresh_sim.url, names=("fast",))
    queries = tmp_path / "q4.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 4), queries)
    r = run_cli("run", queries, "--pool", fast, "--data-dir", data, "--run-id", "done", "--quiet", "--no-cache")
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = {rid: orjson.loads((data / "runs" / rid / "manifest.json").read_bytes()) for rid in ("stopped", "done")}
    assert manifest["stopped"]["interrupted_wall_time_s"] > 0

    r = cli("sql", "SELECT * FROM runs ORDER BY run_id", "--data-dir", data, "--format", "json")
    rows = {row["run_id"]: row for row in _rows(r)}
    _check_spend(rows, manifest["stopped"], manifest["done"])
    total = _rows(cli("sql", "SELECT sum(spent_usd) AS usd FROM runs", "--data-dir", data, "--format", "json"))
    assert total == [{"usd": pytest.approx(rows["stopped"]["spent_usd"] + rows["done"]["spent_usd"])}]
    # The view's columns it always had are as they were, the new ones after them
    r = cli("sql", "SELECT column_name, column_type FROM (DESCRIBE runs)", "--data-dir", data, "--format", "json")
    assert [(c["column_name"], c["column_type"]) for c in _rows(r)] == RUNS_COLUMNS + [
        ("spent_usd", "DOUBLE"), ("spend", "JSON"), ("lost_in_flight", "JSON"), ("interrupted_wall_time_s", "DOUBLE"),
        ("failed_in", "VARCHAR"), ("error", "VARCHAR"), ("settings", "JSON")]

    # Runs from before the manifest kept these fields: a finished one's spend is its summary's cost
    old = {k: v for k, v in manifest["done"].items() if k not in ("spend", "lost_in_flight")}
    old["summary"] = {k: v for k, v in old["summary"].items() if k not in ("spend", "lost_in_flight")}
    (data / "runs" / "old").mkdir()
    (data / "runs" / "old" / "manifest.json").write_bytes(orjson.dumps({**old, "run_id": "old"}))
    (data / "runs" / "older").mkdir()
    (data / "runs" / "older" / "manifest.json").write_bytes(orjson.dumps(
        {k: manifest["stopped"][k] for k in ("created_at", "updated_at", "inputs")}
        | {"run_id": "older", "status": "executing"}))
    r = cli("sql", "SELECT run_id, status, spent_usd, spend, lost_in_flight FROM runs ORDER BY run_id",
            "--data-dir", data, "--format", "json")
    rows = {row["run_id"]: row for row in _rows(r)}
    assert rows["old"] == {"run_id": "old", "status": "complete", "spent_usd": old["summary"]["cost_usd"],
                           "spend": None, "lost_in_flight": None}
    assert rows["older"] == {"run_id": "older", "status": "executing", "spent_usd": None, "spend": None,
                             "lost_in_flight": None}
    assert rows["stopped"]["spent_usd"] == _run_cap(manifest["stopped"]["spend"])
    # Any DuckDB client reads the catalog's view the same way
    with duckdb.connect(str(data / "conductor.duckdb"), read_only=True) as con:
        got = dict(con.sql("SELECT run_id, spent_usd FROM runs").fetchall())
    assert got == {"stopped": _run_cap(manifest["stopped"]["spend"]), "done": rows["done"]["spent_usd"],
                   "old": old["summary"]["cost_usd"], "older": None}


@needs_moto
@pytest.mark.slow  # whole runs through the CLI, one stopped by Ctrl-C
def test_the_stores_runs_view_shows_an_interrupted_runs_spend(tmp_path, s3, fresh_sim, sample_queries):
    from conductor.execute.shared.objects import ObjectStore

    store = "s3://conductor-test/spend"
    machine = tmp_path / "machine-a"
    _interrupted_run(["run", sample_queries, "--pool", _slow_pool(tmp_path, fresh_sim), "--data-dir", machine,
                      "--store", store, "--run-id", "stopped", "--quiet", "--no-cache"],
                     machine / "runs" / "stopped" / "work" / "steps.jsonl")
    fast = write_pool(tmp_path / "fast.yaml", fresh_sim.url, names=("fast",))
    queries = tmp_path / "q4.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 4), queries)
    r = run_cli("run", queries, "--pool", fast, "--data-dir", machine, "--store", store, "--run-id", "done",
                "--quiet", "--no-cache")
    assert r.returncode == 0, r.stdout + r.stderr
    objects = ObjectStore(store)
    manifest = {}
    for rid in ("stopped", "done"):
        with objects.fs.open_input_stream(objects.path("runs", rid, "manifest.json")) as f:
            manifest[rid] = orjson.loads(f.read())
    # the store's copy has the interrupted command's time, as the local one (it was written after the last upload)
    local = orjson.loads((machine / "runs" / "stopped" / "manifest.json").read_bytes())
    assert manifest["stopped"].get("interrupted_wall_time_s") == local["interrupted_wall_time_s"] > 0

    # A run an error stopped: why, as the local view shows it (the store's view had them null)
    failed = {**manifest["done"], "run_id": "failed", "status": "failed", "failed_in": "planning",
              "error": "LLM planner: cannot plan: HTTP 401"}
    with objects.fs.open_output_stream(objects.path("runs", "failed", "manifest.json")) as f:
        f.write(orjson.dumps(failed))

    # Answered from the store alone: another machine's empty data folder
    r = run_cli("sql", "SELECT * FROM runs ORDER BY run_id", "--store", store, "--format", "json",
                "--data-dir", tmp_path / "elsewhere")
    rows = {row["run_id"]: row for row in _rows(r)}
    assert (rows["failed"]["failed_in"], rows["failed"]["error"]) == ("planning", failed["error"])
    assert rows["done"]["failed_in"] is None and rows["done"]["error"] is None
    del rows["failed"]
    _check_spend(rows, manifest["stopped"], manifest["done"])
    r = run_cli("sql", "SELECT column_name, column_type FROM (DESCRIBE runs)", "--store", store, "--format", "json")
    assert [(c["column_name"], c["column_type"]) for c in _rows(r)] == RUNS_COLUMNS + [
        ("spent_usd", "DOUBLE"), ("spend", "JSON"), ("lost_in_flight", "JSON"), ("interrupted_wall_time_s", "DOUBLE"),
        ("failed_in", "VARCHAR"), ("error", "VARCHAR"), ("settings", "JSON")]
    r = run_cli("sql", "SELECT sum(spent_usd) AS usd FROM runs WHERE run_id != 'failed'", "--store", store,
                "--format", "json")
    assert _rows(r) == [{"usd": pytest.approx(rows["stopped"]["spent_usd"] + rows["done"]["spent_usd"])}]


def _query_set(path, sample_queries, first: int, **extra):
    """Queries cut from the sample set, with other columns the user's own query set carries."""
    rows = pl.read_parquet(sample_queries).slice(first, 2)
    rows.with_columns(**{k: pl.Series(k, v) for k, v in extra.items()}).write_parquet(path)
    return path


@needs_moto
@pytest.mark.slow  # whole runs through the CLI
def test_the_stores_catalog_reads_a_carried_column_of_different_types_as_text(tmp_path, s3, fresh_sim,
                                                                              sample_queries):
    """`conductor sql --store` failed for every run and every view once two runs' query sets carried
    a column of different types; the local catalog reads it as text."""
    from conductor.execute.shared.objects import ObjectStore

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    store, machine = "s3://conductor-test/mixed", tmp_path / "machine-a"
    sets = {"ints": dict(extra=[1, 2], score=[3, 4]), "lists": dict(extra=[[1, 2], [3]], score=[0.5, 1.5]),
            "texts": dict(extra=["abc", "def"])}
    for i, (run_id, extra) in enumerate(sets.items()):
        queries = _query_set(tmp_path / f"{run_id}.parquet", sample_queries, 2 * i, **extra)
        r = run_cli("run", queries, "--pool", pool, "--data-dir", machine, "--store", store, "--run-id", run_id,
                    "--quiet")
        assert r.returncode == 0, r.stdout + r.stderr

    r = run_cli("sql", "SELECT * FROM results", "--store", store, "--format", "json", "--data-dir", tmp_path / "b")
    assert sorted((row["run_id"], row["extra"]) for row in _rows(r)) == [
        ("ints", "1"), ("ints", "2"), ("lists", "[1,2]"), ("lists", "[3]"), ("texts", "abc"), ("texts", "def")]
    assert "damaged" not in r.stderr, r.stderr
    r = run_cli("sql", "SELECT column_name, column_type FROM (DESCRIBE results) WHERE column_name IN "
                       "('extra', 'score', 'query_index', 'cost_usd', 'started_at', 'calls') ORDER BY 1",
                "--store", store, "--format", "csv")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1:] == ["calls,INTEGER", "cost_usd,DOUBLE", "extra,VARCHAR", "query_index,BIGINT",
                                         "score,DOUBLE", "started_at,TIMESTAMP WITH TIME ZONE"], r.stdout
    r = run_cli("sql", "SELECT sum(score) AS s, count(*) AS n FROM results", "--store", store, "--format", "json")
    assert _rows(r) == [{"s": 9.0, "n": 6}]

    # A column of the schema itself of another type in one run's file (as another conductor version may
    # write it): that view is left out, naming the column, both types and both runs; the others answer
    results = machine / "runs" / "texts" / "results.parquet"
    table = pq.read_table(results)
    table = table.set_column(table.schema.get_field_index("sample"), "sample",
                             pa.array([[s] for s in table.column("sample").to_pylist()], pa.list_(pa.int32())))
    odd = tmp_path / "odd.parquet"
    pq.write_table(table, odd)
    ObjectStore(store).put(odd, "runs", "texts", "results.parquet")
    r = run_cli("sql", "SELECT count(*) AS n FROM results", "--store", store, "--format", "csv")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "there is no view results: column sample of results is INTEGER in run ints" in r.stderr, r.stderr
    assert "INTEGER[] in run texts (s3://conductor-test/mixed/runs/texts/results.parquet)" in r.stderr, r.stderr
    assert "neither object is damaged" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_cli("sql", "SELECT count(*) AS n FROM runs", "--store", store, "--format", "csv")
    assert r.returncode == 0 and r.stdout.splitlines()[1:] == ["3"], r.stdout + r.stderr
    assert "no view results: column sample of results" in r.stderr, r.stderr


def test_a_catalog_made_by_an_older_conductor_gets_the_new_columns(tmp_path):
    """The catalog is rebuilt only when the runs' files change: one made before these columns kept
    its old runs view, and `SELECT spent_usd FROM runs` failed until the next run."""
    folder = tmp_path / "runs" / "a"
    folder.mkdir(parents=True)
    spend = [{"cap": "provider sim", "limit_usd": None, "spent_usd": 0.25}, {"cap": "run", "limit_usd": 1.0,
                                                                              "spent_usd": 0.25}]
    (folder / "manifest.json").write_bytes(orjson.dumps(
        {"run_id": "a", "status": "interrupted", "created_at": "2026-01-01T00:00:00+00:00",
         "updated_at": "2026-01-01T00:01:00+00:00", "inputs": {}, "spend": spend,
         "lost_in_flight": {"calls": 1, "reserved_usd": 0.01}, "interrupted_wall_time_s": 60.0}))
    assert cli("sql", "SELECT 1", "--data-dir", tmp_path).returncode == 0
    # As the conductor before these columns left it: its runs view, and its stamp of the views
    with duckdb.connect(str(tmp_path / "conductor.duckdb")) as con:
        con.execute(f"""CREATE OR REPLACE VIEW runs AS
            SELECT run_id, status, created_at, updated_at, inputs, summary
            FROM read_json('{tmp_path.resolve() / "runs" / "*" / "manifest.json"}', format='auto', union_by_name=true,
                           columns={{run_id: 'VARCHAR', status: 'VARCHAR', created_at: 'TIMESTAMPTZ',
                                     updated_at: 'TIMESTAMPTZ', inputs: 'JSON', summary: 'JSON'}})""")
    stamp = tmp_path / ".conductor.duckdb.views"
    old = orjson.loads(stamp.read_bytes())
    old.pop("shape", None)
    stamp.write_bytes(orjson.dumps(old, option=orjson.OPT_SORT_KEYS))

    r = cli("sql", "SELECT run_id, spent_usd, lost_in_flight, interrupted_wall_time_s FROM runs", "--data-dir",
            tmp_path, "--format", "json")
    assert _rows(r) == [{"run_id": "a", "spent_usd": 0.25, "lost_in_flight": {"calls": 1, "reserved_usd": 0.01},
                         "interrupted_wall_time_s": 60.0}]
    with duckdb.connect(str(tmp_path / "conductor.duckdb"), read_only=True) as con:
        assert con.sql("SELECT sum(spent_usd) FROM runs").fetchall() == [(0.25,)]
