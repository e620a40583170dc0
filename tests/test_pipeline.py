"""The whole pipeline through the CLI, as a user runs it: outputs, SQL, reruns, bad input."""

from __future__ import annotations

import shutil

import duckdb
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conductor import schemas
from tests.conftest import cli, files_under, run_cli, worker, write_pool


@pytest.mark.slow  # whole runs through the CLI
def test_run_writes_all_four_tables_and_sql_reads_them(tmp_path, fresh_sim, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    data = tmp_path / "data"
    r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--run-id", "first")
    assert r.returncode == 0, r.stderr
    for line in ("queries", "valid plans", "accuracy", "cost", "tokens per query", "wall time", "outputs"):
        assert line in r.stdout
    run = data / "runs" / "first"
    for name, schema in schemas.TABLES.items():
        table = pq.read_table(run / f"{name}.parquet")
        assert table.schema.equals(schema), name
    results = pq.read_table(run / "results.parquet")
    assert results.num_rows == 60
    assert set(results.column("status").to_pylist()) == {"ok"}
    traces = pq.read_table(run / "traces.parquet")
    assert all(traces.column("simulated").to_pylist())  # labeled simulated
    assert pq.ParquetFile(run / "traces.parquet").metadata.row_group(0).column(0).compression == "ZSTD"

    r = run_cli("sql", "SELECT (SELECT count(*) FROM plans), (SELECT count(*) FROM traces), "
                       "(SELECT count(*) FROM results), (SELECT count(*) FROM rewards), "
                       "(SELECT count(*) FROM runs)", "--data-dir", data, "--format", "csv")
    assert r.returncode == 0, r.stderr
    counts = [int(x) for x in r.stdout.strip().splitlines()[-1].split(",")]
    assert counts[0] == 60 and counts[1] == traces.num_rows and counts[2] == 60 and counts[3] == 60
    assert counts[4] == 1

    # Accuracy in the summary is what the rewards table says.
    with duckdb.connect(str(data / "conductor.duckdb"), read_only=True) as con:
        acc = con.sql("SELECT avg(correct::INT) FROM rewards").fetchone()[0]
    summary = orjson.loads((run / "summary.json").read_bytes())
    assert summary["accuracy"] == pytest.approx(acc)

    # A new run id leaves the earlier run untouched.
    before = {p: p.stat().st_mtime_ns for p in files_under(run)}
    r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--run-id", "second")
    assert r.returncode == 0, r.stderr
    assert {p: p.stat().st_mtime_ns for p in files_under(run)} == before
    r = run_cli("sql", "SELECT run_id, count(*) FROM results GROUP BY ALL ORDER BY 1", "--data-dir", data,
                "--format", "csv")
    assert r.stdout.strip().splitlines()[1:] == ["first,60", "second,60"]

    # A data folder moved elsewhere answers from its own files, not the old folder's.
    moved = tmp_path / "moved"
    data.rename(moved)
    r = cli("sql", "SELECT count(*) FROM results", "--data-dir", moved, "--format", "csv")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "120", r.stderr


@pytest.mark.slow  # whole runs through the CLI
def test_rerunning_the_same_command_resumes_the_same_run(tmp_path, fresh_sim, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    data = tmp_path / "data"
    first = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--no-cache")
    assert first.returncode == 0, first.stderr
    sent = fresh_sim.log()["total"]
    again = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--no-cache")
    assert again.returncode == 0, again.stderr
    assert "(resumed)" in again.stdout
    assert fresh_sim.log()["total"] == sent  # nothing was sent twice, even without the cache
    assert len(list((data / "runs").iterdir())) == 1

    # The README: work/ is safe to delete once the run is complete. Rerunning then
    # sends nothing and keeps what the answers cost; the wall time adds up.
    (run,) = (data / "runs").iterdir()
    summary = orjson.loads((run / "summary.json").read_bytes())
    traces = pq.read_table(run / "traces.parquet")
    shutil.rmtree(run / "work")
    for _ in range(2):  # the second rerun finds a work folder holding only the lock
        after = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--no-cache")
        assert after.returncode == 0, after.stderr
        assert fresh_sim.log()["total"] == sent
        assert pq.read_table(run / "traces.parquet").equals(traces)
    rerun = orjson.loads((run / "summary.json").read_bytes())
    assert rerun["cost_usd"] == pytest.approx(summary["cost_usd"]) and rerun["cost_usd"] > 0
    assert rerun["calls"] == summary["calls"] and rerun["cache_hits"] == 0
    assert rerun["wall_time_s"] >= summary["wall_time_s"]
    # Every plan ok: --retry-failed (a scheduler may always pass it) has nothing to do.
    r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--no-cache", "--retry-failed")
    assert r.returncode == 0, r.stderr
    # With a failed plan, failed plans cannot be told apart without the journal: refused, nothing sent.
    results = pq.read_table(run / "results.parquet")
    status = results.column("status").to_pylist()
    status[0] = "error"
    pq.write_table(results.set_column(results.schema.get_field_index("status"), "status", pa.array(status)),
                   run / "results.parquet")
    r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--no-cache", "--retry-failed")
    assert r.returncode == 2 and "work folder" in r.stderr and "--run-id" in r.stderr
    assert fresh_sim.log()["total"] == sent


def test_failures_of_a_run_whose_work_folder_was_deleted_are_not_promised_to_a_rerun(tmp_path, fresh_sim,
                                                                                       sample_queries):
    """audit: with work/ deleted, "a rerun retries these" looped for ever: the rerun executes nothing."""
    fresh_sim.set_faults("fast", fail_status=503)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",),
                      providers={"sim": {"max_attempts": 1}})
    cmd = ("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--no-cache", "--quiet")
    r = run_cli(*cmd)
    assert r.returncode == 4 and "a rerun retries these" in r.stdout, r.stdout + r.stderr
    fresh_sim.set_faults("fast")  # back; but the journal goes
    (run,) = (tmp_path / "data" / "runs").iterdir()
    shutil.rmtree(run / "work")
    sent = fresh_sim.log()["total"]
    r = run_cli(*cmd)
    assert r.returncode == 4 and fresh_sim.log()["total"] == sent, r.stdout + r.stderr
    assert "a rerun retries these" not in r.stdout and "rerun the same command" not in r.stderr
    assert "final: the run's work folder (its journal) was deleted" in r.stdout
    assert "start a new run (another --run-id)" in r.stderr


def test_run_id_follows_what_the_planner_reads(tmp_path, sample_queries):
    """Skills, prices and descriptions decide the plans: changing one starts a new run
    instead of resuming plans made with the old ones; a budget does not."""
    from conductor import runids, runner

    def run_id(path, **changes):
        w = worker("fast", "http://127.0.0.1:9")
        w.update(changes)
        pool = write_pool(tmp_path / path, "http://127.0.0.1:9", workers=[w],
                          providers={"sim": {"budget_usd": 1.0 if "budget" in path else 5.0}})
        return runner.prepare(runner.RunConfig(queries=sample_queries, pool=pool, data_dir=tmp_path / "data"))

    base = run_id("a.yaml")
    assert run_id("budget.yaml").dir.run_id == base.dir.run_id
    for change in ({"skills": {"math": 0.9}}, {"description": "a careful model"},
                   {"price": {"input_per_mtok": 3.0, "output_per_mtok": 2.0}}):
        assert run_id("b.yaml", **change).dir.run_id != base.dir.run_id, change

    # A run begun by a version whose ids left them out resumes under its id.
    m = base.dir.read_manifest()
    del m["inputs"]["pool_planning"]
    legacy = {k: v for k, v in m["inputs"].items() if k not in ("queries", "pool")}
    m["fingerprint"] = runids.digest(legacy)
    old_id = f"{sample_queries.stem}-{m['fingerprint'][:10]}"
    m["run_id"] = old_id
    base.dir.path.rename(base.dir.path.with_name(old_id))
    runner.RunDir(tmp_path / "data", old_id).write_manifest(m)
    again = run_id("a.yaml")
    assert again.resumed and again.dir.run_id == old_id


@pytest.mark.slow  # a whole run through the CLI
def test_invalid_plans_say_why(tmp_path, fresh_sim, sample_queries):
    """Plans that never ran leave no trace to explain them: the summary gives their errors."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    queries = tmp_path / "q3.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 3), queries)
    r = run_cli("run", queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet", "--planner", "llm",
                "--planner-model", "openai/fast", "--planner-option", f"api_base={fresh_sim.url}")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "invalid plans (no step ran), most common reasons:\n  3 plan(s): no plan found" in r.stdout, r.stdout
    # a rerun keeps the plans: the exit message must not promise that rerunning mends them
    assert "3 of them are invalid plans, which a rerun does not plan again" in r.stderr, r.stderr


@pytest.mark.slow  # whole runs through the CLI
def test_sql_errors_are_clear(tmp_path, fresh_sim, sample_queries):
    r = cli("sql", "SELECT 1", "--data-dir", tmp_path / "empty")
    assert r.returncode == 2 and "no runs under" in r.stderr
    (tmp_path / "half" / "runs" / "refused-run").mkdir(parents=True)  # an older version's refused job run
    r = cli("sql", "SELECT count(*) FROM runs", "--data-dir", tmp_path / "half")
    assert r.returncode == 2 and "Catalog Error" not in r.stderr, r.stderr  # and no "Did you mean pg_tables?"
    assert "there is no view runs: no run under" in r.stderr and "has written a manifest.json yet" in r.stderr
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    data = tmp_path / "data"
    assert run_cli("run", sample_queries, "--pool", pool, "--data-dir", data).returncode == 0
    r = cli("sql", "SELECT nope FROM results", "--data-dir", data)
    assert r.returncode == 2 and "SQL error" in r.stderr and "nope" in r.stderr
    for nothing in ("", "-- just a comment"):
        r = cli("sql", nothing, "--data-dir", data)
        assert r.returncode == 2 and "no SQL statement given" in r.stderr


def test_sql_writes_nested_values_as_json_and_runs_one_query_at_a_time(tmp_path):
    """CSV cells held Python reprs ({'a': 1}), a MAP with integer keys crashed --format json,
    and of `SELECT 1; SELECT 2` only the last result was shown."""
    (tmp_path / "runs").mkdir()
    q = "SELECT {'a': 1, 'b': [1, 2]} AS s, MAP {1: 'x'} AS m, 1.5::DECIMAL(10, 2) AS d, NULL AS n"
    r = cli("sql", q, "--data-dir", tmp_path, "--format", "csv")
    assert r.returncode == 0 and r.stdout.splitlines() == ["s,m,d,n", '"{""a"":1,""b"":[1,2]}","{""1"":""x""}",1.50,'], r
    r = cli("sql", q, "--data-dir", tmp_path, "--format", "json")
    assert r.returncode == 0 and orjson.loads(r.stdout) == {"s": {"a": 1, "b": [1, 2]}, "m": {"1": "x"}, "d": "1.50",
                                                            "n": None}, r
    r = cli("sql", "SELECT 1; SELECT 2", "--data-dir", tmp_path)
    assert r.returncode == 2 and "runs one query at a time; got 2 statements" in r.stderr and r.stdout == ""


# ---- bad input: exit status, message, and nothing written ------------------

def _write(path, **cols):
    pq.write_table(pa.table(cols), path)
    return path


BAD_QUERY_SETS = {
    "missing_file": (None, ["file not found"]),
    "not_parquet": ("garbage", ["not a readable Parquet file"]),
    "no_prompt_column": ({"query_id": ["a", "b"], "text": ["x", "y"]}, ["column 'prompt' is missing"]),
    "no_id_column": ({"prompt": ["x"]}, ["column 'query_id' is missing"]),
    "null_and_empty_prompts": ({"query_id": ["a", "b", "c"], "prompt": ["ok", None, "  "]},
                               ["column 'prompt' is null or empty", "'b'", "'c'"]),
    "duplicate_ids": ({"query_id": ["a", "b", "a", "c", "c"], "prompt": list("vwxyz")},
                      ["column 'query_id' has 2 duplicate id(s)", "'a'", "'c'"]),
    "unknown_task": ({"query_id": ["a", "b"], "prompt": ["x", "y"], "task": ["math", "poetry"]},
                     ["column 'task' has unknown value(s) 'poetry'", "'b'"]),
    "bad_metadata": ({"query_id": ["a", "b"], "prompt": ["x", "y"], "metadata": ['{"k": 1}', "{oops"]},
                     ["column 'metadata' is not valid JSON", "'b'"]),
    "prompt_not_text": ({"query_id": ["a"], "prompt": [3]}, ["column 'prompt' must hold strings"]),
    "reference_as_floats": ({"query_id": ["a"], "prompt": ["x"], "reference": [2.5]},
                            ["column 'reference' must hold strings, not double (write it as text"]),
}


def test_integer_references_are_read_as_text():
    """A math set's gold numbers are often integers: they were refused (audit47 F9)."""
    import pyarrow as pa

    from conductor.queries import validate

    t = validate(pa.table({"query_id": [1, 2], "prompt": ["1+1?", "2+2?"], "reference": [2, 4]}), "q.parquet")
    assert t.column("reference").to_pylist() == ["2", "4"] and t.column("query_id").to_pylist() == ["1", "2"]


@pytest.mark.parametrize("case", sorted(BAD_QUERY_SETS))
def test_bad_query_set_is_refused_and_nothing_is_written(tmp_path, case, fresh_sim):
    content, expected = BAD_QUERY_SETS[case]
    path = tmp_path / f"{case}.parquet"
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, dict):
        _write(path, **content)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    data = tmp_path / "data"
    r = cli("run", path, "--pool", pool, "--data-dir", data)
    assert r.returncode == 2
    assert str(path) in r.stderr
    for text in expected:
        assert text in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert files_under(data) == []
    assert fresh_sim.log()["total"] == 0


def test_bad_pool_file_is_refused_and_nothing_is_written(tmp_path, sample_queries):
    pool = tmp_path / "pool.yaml"
    pool.write_text("workers:\n  - id: a\n    model: openai/a\n    price: {input_per_mtok: cheap, output_per_mtok: 1}\n")
    data = tmp_path / "data"
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", data)
    assert r.returncode == 2
    assert f"pool file {pool}" in r.stderr and "workers[0] (a).price.input_per_mtok: must be a number" in r.stderr
    assert files_under(data) == []


@pytest.mark.parametrize("flag, value", [("--budget", "nan"), ("--budget", "-1.0"), ("--cost-penalty", "nan"),
                                         ("--cost-penalty", "inf"),
                                         ("--max-steps", "100000000000000000000")])  # was an orjson traceback
def test_a_budget_or_cost_penalty_that_is_no_number_is_refused_and_nothing_is_written(tmp_path, sample_queries,
                                                                                       flag, value):
    """NaN passes every `< 0` check and then makes every budget comparison false: an unlimited budget."""
    data = tmp_path / "data"
    pool = write_pool(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1")  # never reached
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", data, flag, value)
    assert r.returncode == 2 and f"{flag} " in r.stderr and f"(got {value})" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert files_under(data) == []


def test_a_data_dir_that_is_a_file_is_refused(tmp_path, sample_queries):
    f = tmp_path / "data"
    f.write_text("not a folder")
    r = cli("run", sample_queries, "--pool", write_pool(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1"),
            "--data-dir", f)
    assert r.returncode == 2 and f"--data-dir {f}: is a file; give a folder" in r.stderr
    r = cli("run", sample_queries, "--pool", tmp_path / "pool.yaml", "--data-dir", f / "sub")  # was a traceback
    assert r.returncode == 2 and f"--data-dir {f / 'sub'}: {f} is a file; give a folder" in r.stderr, r.stderr


@pytest.mark.parametrize("args, message", [
    (["--seed", "99999999999999999999999"], "argument --seed: 99999999999999999999999 is out of range"),
    (["--seed", "x"], "argument --seed: 'x' is not a whole number"),
    (["--max-failed-share", "2"], "argument --max-failed-share: 2 is out of range (0 to 1)"),  # named the flag not
    (["--run-id", ""], "argument --run-id: an empty run id"),  # was the default id, silently
])
def test_a_seed_out_of_range_is_refused_by_argparse(tmp_path, sample_queries, args, message):
    r = cli("run", sample_queries, "--pool", write_pool(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1"),
            "--data-dir", tmp_path / "data", *args)
    assert r.returncode == 2 and message in r.stderr and files_under(tmp_path / "data") == []


@pytest.mark.parametrize("option, message", [
    ("cost_weight=.nan", "cost_weight must be a finite number, at least 0 (got nan)"),
    ("cost_weight=abc", "cost_weight must be a finite number, at least 0 (got 'abc')"),
    ("temperature=-1", "temperature must be a finite number, at least 0 (got -1)"),
    ("explore=abc", "explore must be between 0 and 1 (got 'abc')"),
    ("default_skill=2", "default_skill must be between 0 and 1 (got 2)"),
    ("ensemble_size=0", "ensemble_size must be a whole number, at least 2 (got 0)"),
    ("expected_output_tokens=1.5", "expected_output_tokens must be a whole number, at least 1 (got 1.5)"),
    ("templates=bogus", "templates must name one or more of single, verify, ensemble"),
    ("templates=[]", "templates must name one or more of single, verify, ensemble"),
])
def test_a_bad_embedded_planner_option_is_refused_and_nothing_is_written(tmp_path, sample_queries, option, message):
    """Options arrive as YAML scalars; a NaN weight or a word used to crash planning with a traceback."""
    data = tmp_path / "data"
    pool = write_pool(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1")  # never reached
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--planner-option", option)
    assert r.returncode == 2 and f"planner embedded: {message}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert files_under(data) == []


@pytest.mark.slow  # whole runs through the CLI
def test_reusing_a_run_id_for_other_inputs_is_refused(tmp_path, fresh_sim, sample_queries):
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    data = tmp_path / "data"
    assert run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--run-id", "x").returncode == 0
    before = {p: p.stat().st_mtime_ns for p in files_under(data / "runs")}
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--run-id", "x", "--samples", "2")
    assert r.returncode == 2 and "run x already exists" in r.stderr
    assert {p: p.stat().st_mtime_ns for p in files_under(data / "runs")} == before


@pytest.mark.parametrize("value", ["0", "100000000"])
def test_samples_outside_one_to_the_cap_are_refused_before_anything_is_written(tmp_path, sample_queries, value):
    """100,000,000 plans a query used to fill memory before any message."""
    data = tmp_path / "data"
    r = cli("run", sample_queries, "--pool", write_pool(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1"),
            "--data-dir", data, "--samples", value)
    assert r.returncode == 2 and f"--samples is plans per query: 1 to 4096 (got {value})" in r.stderr, r.stderr
    assert files_under(data) == []



def test_the_catalog_of_a_data_folder_not_made_yet_is_created_empty(tmp_path):
    """The daily enrichment's catalog refresh on a new data folder said to delete a file that
    did not exist."""
    import duckdb

    from conductor.store import refresh_catalog

    db = refresh_catalog(tmp_path / "new" / "data")
    with duckdb.connect(str(db), read_only=True) as con:  # no run yet: no view yet
        assert con.sql("SELECT count(*) FROM duckdb_views() WHERE NOT internal").fetchone() == (0,)
