"""`conductor run` carries the query set's other columns into results.parquet."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from tests.conftest import SAMPLE, run_cli, write_pool
import pytest

# slow: a whole run through the CLI
pytestmark = pytest.mark.slow


def test_run_carries_unconsumed_columns_into_results(tmp_path, fresh_sim):
    q = pq.read_table(SAMPLE).slice(0, 12)
    n = q.num_rows
    q = q.append_column("company", pa.array([f"co{i}" for i in range(n)]))
    q = q.append_column("quarter", pa.array([i % 4 + 1 for i in range(n)], pa.int64()))
    q = q.append_column("status", pa.array(["draft"] * n))  # clashes with a results column
    pq.write_table(q, tmp_path / "q.parquet")
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    r = run_cli("run", tmp_path / "q.parquet", "--pool", pool, "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 0, r.stderr
    results = pq.read_table(next((tmp_path / "data" / "runs").glob("*/results.parquet")))
    got = {row["query_id"]: row for row in results.to_pylist()}
    assert len(got) == n
    for i, qid in enumerate(q.column("query_id").to_pylist()):
        assert got[qid]["company"] == f"co{i}" and got[qid]["quarter"] == i % 4 + 1
        assert got[qid]["input_status"] == "draft" and got[qid]["status"] != "draft"
    assert results.schema.field("quarter").type == pa.int64()
