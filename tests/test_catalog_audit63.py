"""The catalog across runs as a user queries it (audit63): runs whose query sets carry a column of
different types (F2), a data folder copied elsewhere (F3), and a data folder holding only an
interrupted run (F6). Real `conductor run` runs against the simulated pool, the real catalog file,
`conductor sql`, and a plain DuckDB client on the catalog."""

from __future__ import annotations

import os
import shutil
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

from tests.conftest import REPO, cli, run_cli, write_pool


def _csv(r) -> list[list[str]]:
    assert r.returncode == 0, r.stdout + r.stderr
    return [line.split(",", 1) for line in r.stdout.strip().splitlines()[1:]]


def _query_set(path, sample_queries, first: int, **extra):
    """Queries cut from the sample set, with other columns the user's own query set carries."""
    rows = pl.read_parquet(sample_queries).slice(first, 2)
    rows.with_columns(**{k: pl.Series(k, v) for k, v in extra.items()}).write_parquet(path)
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, sim, sample_queries):
    """Three finished runs whose query sets carry `extra` as BIGINT, BIGINT[] and VARCHAR, and
    `score` as BIGINT and DOUBLE."""
    sim.clear_faults()
    root = tmp_path_factory.mktemp("mixed")
    pool = write_pool(root / "pool.yaml", sim.url, names=("fast",))
    data = root / "data"
    sets = {"ints": dict(extra=[1, 2], score=[3, 4]), "lists": dict(extra=[[1, 2], [3]], score=[0.5, 1.5]),
            "texts": dict(extra=["abc", "def"])}
    for i, (run_id, extra) in enumerate(sets.items()):
        queries = _query_set(root / f"{run_id}.parquet", sample_queries, 2 * i, **extra)
        r = run_cli("run", queries, "--pool", pool, "--data-dir", data, "--run-id", run_id, "--quiet")
        assert r.returncode == 0, r.stdout + r.stderr
    return data


@pytest.mark.slow  # whole runs through the CLI
def test_runs_whose_carried_column_differs_in_type_stay_queryable_together(mixed):
    """`SELECT *` over results failed for every run, calling the older run's healthy file damaged."""
    r = cli("sql", "SELECT * FROM results", "--data-dir", mixed, "--format", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [orjson.loads(line) for line in r.stdout.splitlines()]
    assert sorted((row["run_id"], row["extra"]) for row in rows) == [
        ("ints", "1"), ("ints", "2"), ("lists", "[1,2]"), ("lists", "[3]"), ("texts", "abc"), ("texts", "def")]
    assert "damaged" not in r.stderr, r.stderr

    # The carried column is text in the view: a value as its text, a list as its JSON
    r = cli("sql", "SELECT run_id, extra FROM results ORDER BY run_id, query_index", "--data-dir", mixed,
            "--format", "csv")
    assert _csv(r) == [["ints", "1"], ["ints", "2"], ["lists", '"[1,2]"'], ["lists", "[3]"],
                       ["texts", "abc"], ["texts", "def"]], r.stdout
    # Numbers stay numbers (DuckDB widens them), and the schema's own columns keep their types
    r = cli("sql", "SELECT column_name, column_type FROM (DESCRIBE results) WHERE column_name IN "
                   "('extra', 'score', 'query_index', 'cost_usd', 'started_at', 'calls') ORDER BY 1",
            "--data-dir", mixed, "--format", "csv")
    assert _csv(r) == [["calls", "INTEGER"], ["cost_usd", "DOUBLE"], ["extra", "VARCHAR"],
                       ["query_index", "BIGINT"], ["score", "DOUBLE"], ["started_at", "TIMESTAMP WITH TIME ZONE"]]
    r = cli("sql", "SELECT sum(score) FROM results", "--data-dir", mixed, "--format", "csv")
    assert _csv(r) == [["9.0"]], r.stdout

    # Any DuckDB client reads the catalog's views the same way
    with duckdb.connect(str(mixed / "conductor.duckdb"), read_only=True) as con:
        rows = con.sql("SELECT run_id, extra FROM results WHERE query_index = 0 ORDER BY 1").fetchall()
    assert rows == [("ints", "1"), ("lists", "[1,2]"), ("texts", "abc")]


@pytest.mark.slow  # whole runs through the CLI
def test_a_type_clash_duckdb_cannot_read_names_the_column_its_types_and_both_runs(mixed):
    """The runs' files read together by the user's own query: the error called the healthy file
    damaged, and advised rerunning it (which changes nothing) or moving it out."""
    runs = mixed / "runs"
    query = (f"SELECT * FROM read_parquet(['{runs / 'ints' / 'results.parquet'}', "
             f"'{runs / 'lists' / 'results.parquet'}'], union_by_name = true)")
    r = cli("sql", query, "--data-dir", mixed, "--format", "csv")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is damaged or not readable" not in r.stderr and "mv " not in r.stderr, r.stderr
    assert "neither file is damaged" in r.stderr, r.stderr
    assert "column extra is " in r.stderr, r.stderr
    assert "BIGINT in run ints" in r.stderr and "BIGINT[] in run lists" in r.stderr, r.stderr


def _sql_stderr_and_rows(data, query):
    r = cli("sql", query, "--data-dir", data, "--format", "csv")
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stderr, [line for line in r.stdout.strip().splitlines()[1:]]


@pytest.mark.slow  # whole runs through the CLI
def test_a_copied_data_folder_says_once_that_its_catalog_now_reads_the_copy(tmp_path, fresh_sim, sample_queries):
    """A plain DuckDB client on a copy read the original folder's runs; `conductor sql` re-pointed the
    views without a word, so nothing told the user what the catalog had been reading."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    data, copy = tmp_path / "data", tmp_path / "copy"
    queries = _query_set(tmp_path / "q.parquet", sample_queries, 0)
    r = run_cli("run", queries, "--pool", pool, "--data-dir", data, "--run-id", "first", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.copytree(data, copy)
    r = run_cli("run", queries, "--pool", pool, "--data-dir", data, "--run-id", "second", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    with duckdb.connect(str(copy / "conductor.duckdb"), read_only=True) as con:  # before: the original's runs
        assert con.sql("SELECT run_id FROM runs ORDER BY 1").fetchall() == [("first",), ("second",)]

    err, rows = _sql_stderr_and_rows(copy, "SELECT run_id FROM runs ORDER BY 1")
    assert rows == ["first"], rows
    assert f"read the runs under {data.resolve() / 'runs'}" in err, err
    assert f"they read {copy.resolve() / 'runs'} from now on" in err, err
    with duckdb.connect(str(copy / "conductor.duckdb"), read_only=True) as con:  # after: the copy's own
        assert con.sql("SELECT run_id FROM runs ORDER BY 1").fetchall() == [("first",)]
    err, rows = _sql_stderr_and_rows(copy, "SELECT run_id FROM results GROUP BY 1")
    assert rows == ["first"] and err == "", err  # said once, when it happened
    err, rows = _sql_stderr_and_rows(data, "SELECT run_id FROM runs ORDER BY 1")
    assert rows == ["first", "second"] and err == "", err  # the original was never moved


def _wait_for(sim, n, timeout=60):
    deadline = time.monotonic() + timeout
    while sim.log()["total"] < n and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.slow  # a run interrupted through the CLI
def test_with_only_an_interrupted_run_the_missing_traces_view_names_it_and_where_its_steps_are(
        tmp_path, fresh_sim, sample_queries):
    """The error said a run refused before its first call writes no traces.parquet, although the
    interrupted run had paid for its calls."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("slow",), providers={"sim": {"max_concurrency": 2}})
    data = tmp_path / "data"
    queries = tmp_path / "q12.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 12), queries)
    args = ["run", str(queries), "--pool", str(pool), "--data-dir", str(data), "--run-id", "stopped", "--quiet",
            "--no-cache"]
    p = subprocess.Popen([sys.executable, "-m", "conductor", *args], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    _wait_for(fresh_sim, 2)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert orjson.loads((data / "runs" / "stopped" / "manifest.json").read_bytes())["status"] == "interrupted"
    assert (data / "runs" / "stopped" / "work" / "steps.jsonl").stat().st_size > 0

    for view in ("traces", "results"):
        r = cli("sql", f"SELECT count(*) FROM {view}", "--data-dir", data)
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"no run under {data / 'runs'} has written a {view}.parquet yet" in r.stderr, r.stderr
        assert "A run writes it when it ends" in r.stderr and "work/" in r.stderr, r.stderr
        assert "Not ended: stopped (interrupted)" in r.stderr, r.stderr


@pytest.mark.slow  # whole runs through the CLI
def test_a_schema_column_of_another_type_in_one_run_names_the_column_its_types_and_both_runs(mixed, tmp_path):
    """A column of the schema itself whose type differs between two runs' files (as files written by
    different conductor versions may): DuckDB's error named no column and no file."""
    data = tmp_path / "data"
    shutil.copytree(mixed, data)
    shutil.rmtree(data / "runs" / "lists")  # no carried column of clashing types: this is about the schema's
    results = data / "runs" / "texts" / "results.parquet"
    table = pq.read_table(results)
    table = table.set_column(table.schema.get_field_index("sample"), "sample",
                             pa.array([[s] for s in table.column("sample").to_pylist()], pa.list_(pa.int32())))
    pq.write_table(table, results)
    r = cli("sql", "SELECT * FROM results", "--data-dir", data, "--format", "csv")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is damaged or not readable" not in r.stderr and "neither file is damaged" in r.stderr, r.stderr
    assert "column sample of results is INTEGER in run ints" in r.stderr, r.stderr
    assert "INTEGER[] in run texts" in r.stderr, r.stderr
