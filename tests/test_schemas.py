"""Each output table's columns are declared once (conductor.schemas); the README's
schema tables, the Arrow schemas of the files a run writes, the catalog's DuckDB
views and the journal's lines must all say the same."""

from __future__ import annotations

import duckdb
import orjson
import pyarrow.parquet as pq

from conductor import schemas
from conductor.runner import RunConfig, run_all
from conductor.store import create_views, write_table
from tests.conftest import REPO, write_pool

# DESCRIBE spells some types differently from the names a read_json column list takes.
_DESCRIBED = {"TIMESTAMPTZ": "TIMESTAMP WITH TIME ZONE"}


def test_readme_tables_are_the_declared_ones():
    readme = (REPO / "README.md").read_text()
    block = readme.split("<!-- schemas:begin")[1].split("<!-- schemas:end -->")[0].split("\n", 1)[1].strip()
    for name, table in schemas.RECORDS.items():
        assert table.markdown().strip() in block, f"README's {name} table differs: run `python -m conductor.schemas`"


def test_catalog_views_have_the_declared_columns_and_types(tmp_path):
    run = tmp_path / "runs" / "r1"
    for name, table in schemas.RECORDS.items():
        write_table(run / f"{name}.parquet", table.schema.empty_table())
    with duckdb.connect(":memory:") as con:
        create_views(con, tmp_path / "runs")
        for name, table in schemas.RECORDS.items():
            described = {row[0]: row[1] for row in con.execute(f"DESCRIBE {name}").fetchall()}
            declared = {k: _DESCRIBED.get(v, v) for k, v in table.duckdb_types().items()}
            assert described == declared, name


def test_a_run_writes_the_declared_files_and_journal_lines(tmp_path, fresh_sim, sample_queries):
    queries = tmp_path / "q.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 4), queries)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    summary = run_all(RunConfig(queries=queries, pool=pool, data_dir=tmp_path / "data", run_id="s",
                                progress=False))
    run = tmp_path / "data" / "runs" / summary["run_id"]
    for name, table in schemas.RECORDS.items():
        assert pq.read_schema(run / f"{name}.parquet").equals(table.schema), name
    steps = [orjson.loads(line) for line in (run / "work" / "steps.jsonl").read_bytes().splitlines()]
    plans = [orjson.loads(line) for line in (run / "work" / "plans.jsonl").read_bytes().splitlines()]
    assert steps and plans
    for line in steps:
        assert set(line) - {"_seq"} == set(schemas.RECORDS["traces"].names), set(line) ^ set(schemas.TRACES.names)
    for line in plans:
        assert set(line) - {"_seq"} == set(schemas.PLAN_LINE.names), set(line) ^ set(schemas.PLAN_LINE.names)


def test_records_are_typed_rows_of_the_declared_columns():
    row = schemas.RECORDS["results"].record(run_id="r", plan_id="q#0", status="ok")
    assert tuple(row.__dataclass_fields__) == schemas.RECORDS["results"].names
    assert row.cost_usd is None
