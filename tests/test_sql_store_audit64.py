"""audit64 F4: `conductor sql --store` on a mistyped bucket said no run had written results yet,
sending the user to start a run, which then failed differently; it names the bucket, as `run` does."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

pytest.importorskip("moto", reason="moto[server] is not installed (pip install -e '.[test]')")


@pytest.fixture
def s3(monkeypatch):
    from conductor.execute.shared.servers import S3Server

    with S3Server() as server:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        server.create_bucket("conductor-runs")
        yield server


def test_sql_on_a_bucket_that_does_not_exist_names_it(s3):
    r = run_cli("sql", "SELECT count(*) FROM results", "--store", "s3://conductor-runz/dev")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "store s3://conductor-runz/dev: bucket 'conductor-runz' does not exist" in r.stderr, r.stderr
    assert "no run" not in r.stderr and "Traceback" not in r.stderr


def test_sql_on_an_empty_existing_bucket_still_says_no_run_has_written_results(s3):
    r = run_cli("sql", "SELECT count(*) FROM results", "--store", "s3://conductor-runs/dev")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "does not exist" not in r.stderr and "results" in r.stderr, r.stderr
