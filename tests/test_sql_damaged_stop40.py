"""A view whose only file is damaged: `conductor sql` named the damaged file, then ended saying no
run had written that file yet, which contradicted the line before (audit67 F5)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tests.conftest import run_cli, write_pool


@pytest.mark.parametrize("view, name", [("traces", "traces.parquet"), ("runs", "manifest.json")])
def test_a_view_whose_only_file_is_damaged_says_so(tmp_path, fresh_sim, sample_queries, view, name):
    queries = tmp_path / "q.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 3), queries)
    data = tmp_path / "data"
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    assert run_cli("run", queries, "--pool", pool, "--data-dir", data, "--quiet").returncode == 0
    (damaged,) = data.glob(f"runs/*/{name}")
    damaged.write_bytes(damaged.read_bytes()[:-100])
    r = run_cli("sql", f"SELECT count(*) FROM {view}", "--data-dir", data)
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(damaged) in r.stderr, r.stderr  # named, with what to do
    assert "has written" not in r.stderr, r.stderr
    assert f"there is no view {view}: every {name} under {data / 'runs'} is damaged or unreadable" in r.stderr
