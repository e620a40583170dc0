"""An API key planted in the environment never appears in any output: traces,
logs, Parquet, DuckDB, the cache, the journal, or error messages."""

from __future__ import annotations

import secrets

import yaml

from conductor.sim import start_sim
from tests.conftest import SAMPLE, files_under, run_cli, worker
import pytest

# slow: whole runs through the CLI with a planted key
pytestmark = pytest.mark.slow


def _leaks(key: str, *texts: str, folders=()) -> list[str]:
    found = [f"text #{i}" for i, t in enumerate(texts) if key in t]
    needle = key.encode()
    for folder in folders:
        found += [str(p) for p in files_under(folder) if needle in p.read_bytes()]
    return found


def test_a_planted_key_appears_in_no_output(tmp_path, sample_queries):
    key = "sk-planted-" + secrets.token_hex(16)
    wrong = "sk-wrong-" + secrets.token_hex(16)
    server_pool = tmp_path / "server.yaml"
    server_pool.write_text(yaml.safe_dump({"workers": [
        {"id": "fast", "model": "openai/fast", "simulate": {"latency_ms": 2}}]}))
    with start_sim(server_pool, [SAMPLE], require_key_env="PLANTED_SIM_KEY", env={"PLANTED_SIM_KEY": key}) as sim:
        pool = tmp_path / "pool.yaml"
        pool.write_text(yaml.safe_dump({
            "providers": {"sim": {"api_key_env": "PLANTED_KEY", "budget_usd": 5}},
            "workers": [worker("fast", sim.url)]}))
        data = tmp_path / "data"

        ok = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--run-id", "good",
                     env={"PLANTED_KEY": key})
        assert ok.returncode == 0, ok.stderr
        assert sim.log()["by_status"].get("200", 0) > 0  # the key was really used
        sql = run_cli("sql", "SELECT * FROM traces", "--data-dir", data, "--format", "json")

        bad = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--run-id", "bad", "--no-cache",
                      env={"PLANTED_KEY": wrong})
        assert bad.returncode == 4  # every plan failed: recorded, and the exit code says so
        assert sim.log()["by_status"].get("401", 0) > 0
        errors = run_cli("sql", "SELECT DISTINCT error FROM results WHERE run_id = 'bad'", "--data-dir", data)
        assert "environment variable PLANTED_KEY" in errors.stdout

        missing = run_cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--run-id", "missing")
        assert missing.returncode == 2 and "environment variable PLANTED_KEY is not set" in missing.stderr

        outputs = [ok.stdout, ok.stderr, sql.stdout, bad.stdout, bad.stderr, errors.stdout, missing.stderr,
                   sim.stdout(), sim.stderr()]
        assert _leaks(key, *outputs, folders=[data]) == []
        assert _leaks(wrong, *outputs, folders=[data]) == []
