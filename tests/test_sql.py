"""`conductor sql` as a user drives it: queries only (EXPLAIN ANALYZE runs what it
wraps, so it may wrap only a query), exports that stream, CSV that keeps NULL apart
from the empty string, and queries too long for the command line read from stdin."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli


@pytest.fixture
def data(tmp_path):
    (tmp_path / "runs").mkdir()
    return tmp_path


@pytest.mark.parametrize("wrapped", [
    "EXPLAIN ANALYZE COPY (SELECT 42 AS x) TO '{out}'",
    "explain analyse COPY (SELECT 42 AS x) TO '{out}'",
    "/* first */ EXPLAIN -- a comment\n ANALYZE /* another */ COPY (SELECT 42 AS x) TO '{out}'",
    "EXPLAIN (ANALYZE) COPY (SELECT 42 AS x) TO '{out}'",
    "EXPLAIN (ANALYZE, FORMAT json) COPY (SELECT 42 AS x) TO '{out}'",
])
def test_explain_analyze_cannot_run_a_write(data, wrapped):
    out = data / "written.csv"
    r = cli("sql", wrapped.format(out=out), "--data-dir", data)
    assert r.returncode == 2 and "runs queries only" in r.stderr and "refused: EXPLAIN COPY" in r.stderr, r
    assert not out.exists()


# A local file for INSTALL: were it ever run, it must not try to download anything.
@pytest.mark.parametrize("statement", ["INSTALL '/nonexistent/x.duckdb_extension'", "CHECKPOINT", "SET threads = 1",
                                       "CREATE TABLE t AS SELECT 1"])
def test_explain_analyze_of_other_statements_is_refused(data, statement):
    r = cli("sql", f"EXPLAIN ANALYZE {statement}", "--data-dir", data)
    assert r.returncode == 2 and f"refused: EXPLAIN {statement.split()[0]}" in r.stderr, r


def test_explain_of_a_query_still_works(data):
    for q in ("EXPLAIN SELECT 1", "EXPLAIN ANALYZE SELECT 1", "/* c */ explain (format json) select 1"):
        r = cli("sql", q, "--data-dir", data, "--format", "csv")
        assert r.returncode == 0 and r.stdout.startswith("explain_key,explain_value\n"), (q, r)


def test_csv_keeps_null_apart_from_the_empty_string(data):
    q = "SELECT NULL AS n, '' AS e, true AS t, false AS f, ' pad' AS p, 'a,b' AS c, 'say \"hi\"' AS q, 1.5 AS x"
    r = cli("sql", q, "--data-dir", data, "--format", "csv")
    assert r.returncode == 0, r
    assert r.stdout.splitlines() == ["n,e,t,f,p,c,q,x", ',"",true,false," pad","a,b","say ""hi""",1.5']


def test_intervals_are_written_as_duckdb_writes_them(data):
    # `ended_at - started_at` is an INTERVAL; Python's timedelta would print "30 days, 0:00:00" for a month
    q = ("SELECT INTERVAL '1 month 2 days' AS i, 1 AS i, TIMESTAMP '2026-01-01 10:00:05' - "
         "TIMESTAMP '2026-01-01 09:00:00' AS took, NULL::INTERVAL AS none")
    r = cli("sql", q, "--data-dir", data, "--format", "csv")
    assert r.returncode == 0 and r.stdout.splitlines() == ["i,i_1,took,none", "1 month 2 days,1,01:00:05,"], r
    r = cli("sql", q.replace("1 AS i", "1 AS n"), "--data-dir", data, "--format", "json")
    assert r.returncode == 0 and r.stdout == '{"i":"1 month 2 days","n":1,"took":"01:00:05","none":null}\n', r
    # inside a list, a struct or a map too (audit46: "14 months" came out as "420 days, 0:00:00")
    q = ("SELECT [INTERVAL 14 MONTH] AS l, {'a': INTERVAL 2 DAY, 'b': 1} AS s, MAP {'k': INTERVAL 1 HOUR} AS m, "
         "NULL::INTERVAL[] AS n")
    r = cli("sql", q, "--data-dir", data, "--format", "json")
    assert r.returncode == 0 and r.stdout == ('{"l":["1 year 2 months"],"s":{"a":"2 days","b":1},'
                                              '"m":{"k":"01:00:00"},"n":null}\n'), r
    r = cli("sql", q, "--data-dir", data, "--format", "csv")
    assert r.returncode == 0 and r.stdout.splitlines()[1] == \
        '"[""1 year 2 months""]","{""a"":""2 days"",""b"":1}","{""k"":""01:00:00""}",', r


def test_exports_stream_every_row(data):
    n = 123_457  # more than one batch
    for fmt in ("csv", "json"):
        r = cli("sql", f"SELECT range AS i FROM range({n})", "--data-dir", data, "--format", fmt)
        lines = r.stdout.splitlines()
        assert r.returncode == 0 and len(lines) == n + (fmt == "csv"), (fmt, len(lines))
        assert lines[-1] == (str(n - 1) if fmt == "csv" else f'{{"i":{n - 1}}}')


def test_a_query_too_long_for_the_command_line_is_read_from_stdin(data):
    ids = ",".join(f"'p{i}'" for i in range(30_000))  # ~240 kB: over Linux's 128 kB for one argument
    query = f"SELECT count(*) AS n FROM (SELECT unnest([{ids}]) AS id)"
    r = subprocess.run([sys.executable, "-m", "conductor", "sql", "-", "--data-dir", str(data), "--format", "csv"],
                       input=query, capture_output=True, text=True, cwd=REPO, timeout=60,
                       env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert r.returncode == 0 and r.stdout.split() == ["n", "30000"], r.stderr


def test_table_width_can_be_widened(data):
    q = "SELECT " + ", ".join(f"'{'v' * 20}' AS column_{i}" for i in range(12))
    narrow = cli("sql", q, "--data-dir", data)
    wide = cli("sql", q, "--data-dir", data, "--max-width", "1000")
    assert narrow.returncode == wide.returncode == 0
    assert "column_5" not in narrow.stdout and "shown)" in narrow.stdout  # the middle columns left out
    assert all(f"column_{i} " in wide.stdout for i in range(12)) and "shown)" not in wide.stdout


def test_json_keeps_every_column_of_the_same_name(data):
    """audit46 F8: one JSON key per column name, so `1 AS x, ... AS x` came out as {"x":"1 month"}.
    Repeated names are made unique as DuckDB makes them (`SELECT * FROM (...)`, COPY TO CSV)."""
    r = cli("sql", "SELECT 1 AS x, INTERVAL 1 MONTH AS x", "--data-dir", data, "--format", "json")
    assert r.returncode == 0 and r.stdout == '{"x":1,"x_1":"1 month"}\n', r
    q = "SELECT 1 AS x, 2 AS x, 3 AS x_1, 4 AS X, 5 AS y"
    r = cli("sql", q, "--data-dir", data, "--format", "json")
    duckdb_names = cli("sql", f"SELECT * FROM ({q})", "--data-dir", data, "--format", "csv").stdout.splitlines()[0]
    assert duckdb_names == "x,x_1,x_1_1,X_2,y"
    assert r.returncode == 0 and r.stdout == '{"x":1,"x_1":2,"x_1_1":3,"X_2":4,"y":5}\n', r
    csv = cli("sql", q, "--data-dir", data, "--format", "csv")  # its header repeated x, read back as one column
    assert csv.returncode == 0 and csv.stdout.splitlines()[0] == duckdb_names, csv


def test_an_error_in_table_format_quotes_the_query_without_the_limit_duckdb_adds(data):
    """The quoted line ended in `LIMIT 10000`, which the user never wrote."""
    r = cli("sql", "SELECT 'a'::INTEGER AS n LIMIT 3", "--data-dir", data)
    assert r.returncode == 2 and "Could not convert string 'a'" in r.stderr, r.stderr
    assert "LIMIT 3\n" in r.stderr and "10000" not in r.stderr, r.stderr


def test_json_columns_are_objects_and_blobs_read_as_duckdb_writes_them(data):
    """The runs view's inputs and summary came out of --format json as strings of JSON, and a
    BLOB as Python's b'...' in CSV and JSON."""
    import orjson

    q = ("SELECT '{\"a\": 1, \"n\": 123456789012345678901234567890}'::JSON AS j, "
         "'\\xAA\\x00ab'::BLOB AS b")
    r = cli("sql", q, "--data-dir", data, "--format", "json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == '{"j":{"a":1,"n":123456789012345678901234567890},"b":"\\\\xAA\\\\x00ab"}'
    assert orjson.loads(r.stdout)["j"]["a"] == 1  # a 30-digit number kept as written, not rounded
    r = cli("sql", q, "--data-dir", data, "--format", "csv")
    assert r.returncode == 0 and r.stdout.splitlines()[1].endswith(",\\xAA\\x00ab"), r.stdout
