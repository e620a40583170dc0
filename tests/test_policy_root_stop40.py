"""$CONDUCTOR_POLICY_DIR naming no folder: planning with policy=auto used the prior without a word,
so a typo or an unmounted volume silently dropped the learned policy (stop 39's carried item)."""

from __future__ import annotations

import pyarrow.parquet as pq

from tests.conftest import run_cli, write_pool


def test_a_policy_dir_that_is_not_a_folder_is_said_and_the_prior_plans(tmp_path, fresh_sim, sample_queries):
    queries = tmp_path / "q.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 3), queries)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    missing = tmp_path / "policies-typo"
    r = run_cli("run", queries, "--pool", pool, "--data-dir", tmp_path / "a", "--quiet",
                env={"CONDUCTOR_POLICY_DIR": str(missing)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"warning: CONDUCTOR_POLICY_DIR={missing} is not a folder" in r.stderr, r.stderr
    assert r.stderr.count("CONDUCTOR_POLICY_DIR=") == 1  # once, not per query
    missing.mkdir()  # an empty folder: no policy yet for this pool, as before training; nothing to warn of
    r = run_cli("run", queries, "--pool", pool, "--data-dir", tmp_path / "b", "--quiet",
                env={"CONDUCTOR_POLICY_DIR": str(missing)})
    assert r.returncode == 0 and "CONDUCTOR_POLICY_DIR" not in r.stderr, r.stderr
